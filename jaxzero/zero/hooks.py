"""How a ZeRO feature hooks into the loss: one protocol that ``layers=``, ``vocab_parallel=``
and ``units=`` each answer, so the gradient step asks a list of hooks and knows none of them
(decision 34).

A hook is the plan of one traced step. Its :meth:`LossHook.scope` makes the plan visible to
what the model calls while the loss is traced (:func:`jaxzero.gather_layer`,
:class:`jaxzero.VocabParallelEmbed`), :meth:`LossHook.wrap` rewrites the loss itself
(``units=`` evaluates it unit by unit), :meth:`LossHook.explain` turns an error the loss
raised into the user's fix, and :meth:`LossHook.finish` checks, after the trace, that the
model used what it was handed.
"""

from __future__ import annotations

import contextlib
import contextvars


class LossHook:
    """The questions the gradient step asks each feature; the defaults do nothing."""

    def scope(self):
        """A context manager inside which the loss is traced."""
        return contextlib.nullcontext()

    def wrap(self, fn):
        """The loss ``fn`` as this feature runs it."""
        return fn

    def explain(self, error: Exception) -> Exception | None:
        """A clearer error for ``error``, raised by the loss, or None to let it through."""
        return None

    def finish(self) -> None:
        """After the loss was traced: raise (or warn) when the model did not use the feature."""

    def emitted(self):
        """What the feature's code produced inside the loss for the step to read after it
        (it leaves the differentiated loss in its aux: :func:`emitting`); None for nothing."""
        return None


class CalledHook(LossHook):
    """A hook that the model's own code must call while the loss is traced
    (:func:`jaxzero.gather_layer`, the vocabulary-parallel functions): inside :meth:`scope` the
    plan is what ``var`` (its class's ``ContextVar``) holds, each call counts in ``calls``,
    and a plan that :meth:`must_be_called` but was not raises :meth:`not_called`'s error."""

    var: contextvars.ContextVar
    calls: int = 0

    def must_be_called(self) -> bool:
        return True

    def not_called(self) -> Exception:
        """The error that says how to call the feature."""
        raise NotImplementedError

    def scope(self):
        return scoped(self.var, self)

    def explain(self, error: Exception) -> Exception | None:
        return self.not_called() if self.must_be_called() and not self.calls else None

    def finish(self) -> None:
        if self.must_be_called() and not self.calls:
            raise self.not_called()


def wrap(hooks, fn):
    """``fn`` wrapped by every hook, the first innermost."""
    for hook in hooks:
        fn = hook.wrap(fn)
    return fn


def emitting(hooks, fn):
    """The loss ``fn`` (``(value, aux)``) returning ``(value, (aux, emitted))``: each hook's
    :meth:`LossHook.emitted` once ``fn`` was traced, out through ``value_and_grad``'s aux."""

    def run(*args):
        value, aux = fn(*args)
        return value, (aux, tuple(hook.emitted() for hook in hooks))

    return run


@contextlib.contextmanager
def scope(hooks):
    """Every hook's :meth:`LossHook.scope` entered."""
    with contextlib.ExitStack() as stack:
        for hook in hooks:
            stack.enter_context(hook.scope())
        yield


def explain(hooks, error: Exception) -> Exception | None:
    """The first hook's explanation of ``error`` (None: no hook has one)."""
    for hook in hooks:
        better = hook.explain(error)
        if better is not None:
            return better
    return None


def finish(hooks) -> None:
    """Every hook's :meth:`LossHook.finish`."""
    for hook in hooks:
        hook.finish()


def plan_var(name: str) -> contextvars.ContextVar:
    """The ``ContextVar`` through which a :class:`CalledHook`'s functions find the plan of the
    step being traced (None outside one)."""
    return contextvars.ContextVar(name, default=None)


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar, value):
    """``var`` set to ``value`` inside the ``with`` block (the plan of a step being traced)."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)
