"""``ZeRO(offload="optimizer")`` on the GPU compile (deviceless, 8 compile-only H100s, as
tests/test_gpu.py): the offloaded state leaves device memory and appears in host memory, byte
for byte, with nothing else on the host; a memory kind that the platform drops is an error, not a state silently kept on the
device.

The offloaded bytes are restated from the sharding rule (a leaf split 8 ways on its largest
dimension divisible by 8, else whole; at per-layer stage 3 a stack on its first divisible
non-layer dimension): the fp32 master, Adam's mu and nu and the fp32 EMA, 16 bytes per local
element, plus Adam's int32 count and the EMA's counter.
"""

from __future__ import annotations

import functools
import math

import jax
import optax
import pytest
from compile_memo import H100, reuse_gpu_compiles
from jax.sharding import NamedSharding

import jaxzero as jz
from jaxzero import cli, gpu
from jaxzero.gpu import report
from jaxzero.gpu.models import abstract_params, batch_shapes, make_loss, model_shape
from jaxzero.zero.offload import placement as offload

N = 8
# hidden 256: the state (3.9 MB per device) outweighs the step's other buffers
SHAPE = model_shape(layers=2, hidden=256, heads=2, vocab=512, seq=16, batch=1)


def _step(stage, per_layer, off):
    zero = jz.ZeRO(
        optax.adam(1e-3),
        gpu.compile_only_mesh("h100", N),
        stage=stage,
        precision="bf16",
        layers="layers" if per_layer else None,
        offload=off,
    )
    return jz.make_train_step(make_loss(SHAPE), zero, ema=jz.ShardedEMA(0.99))


@functools.cache
def _report(stage, per_layer, off):
    step = _step(stage, per_layer, off)
    return gpu.compile_report(step, abstract_params(SHAPE), batch_shapes(SHAPE, N))


def _offloaded_bytes(per_layer):
    """Master + mu + nu + EMA per device (fp32: 16 bytes per local element) + 2 int32s."""
    local = 0
    for path, x in jax.tree_util.tree_flatten_with_path(abstract_params(SHAPE))[0]:
        skip = 1 if per_layer and path[0].key == "layers" else 0
        split = any(d % N == 0 for d in x.shape[skip:])
        local += math.prod(x.shape) // (N if split else 1)
    return 16 * local + 2 * 4


@pytest.mark.parametrize(
    "stage,per_layer",
    [
        # slow: stages 1, 2 and 3 whole (stage 3 per layer stays: the same state, byte for byte,
        # leaves the device; the whole-model stages differ only in the specs)
        pytest.param(1, False, id="1", marks=pytest.mark.slow),
        pytest.param(2, False, id="2", marks=pytest.mark.slow),
        pytest.param(3, False, id="3", marks=pytest.mark.slow),
        pytest.param(3, True, id="3_per_layer"),
    ],
)
def test_gpu_offload_moves_the_state_from_device_to_host_memory(stage, per_layer):
    """The device's persistent bytes drop by exactly the offloaded state, which the host holds
    and nothing more: the streamed update writes every new state leaf into its own donated
    buffer, so the host's outputs alias its inputs and it has no temporaries (host memory =
    the state, decision 32). The device peak drops by at least the state (the update's
    temporaries leave too: it fetches one chunk at a time), and the hidden share of the
    collectives stays as it is without offload."""
    want = _offloaded_bytes(per_layer)
    dev, host = _report(stage, per_layer, None), _report(stage, per_layer, "optimizer")
    assert dev.host_bytes == 0 and dev.host_argument_bytes == 0
    assert dev.argument_bytes - host.argument_bytes == want
    assert host.host_argument_bytes == want
    assert host.host_output_bytes == host.host_alias_bytes == want
    # no host temporaries but a scalar or two (jax 0.12's XLA keeps one 4-byte count there)
    assert host.host_temp_bytes <= 16 and want <= host.host_bytes <= want + 16
    drop = dev.peak_bytes - host.peak_bytes
    assert drop >= want, (drop, want)
    # no host computation in the program: the schedule hides what it hides without offload
    assert host.hidden_share() >= dev.hidden_share() - 0.01


def test_gpu_offload_estimate_moves_the_same_state():
    """``estimate_memory(offload="optimizer")`` moves K + EMA from the device total to
    ``host``: 16 bytes per parameter over N, as the compile does (up to the leaves that stay
    whole)."""
    est = jz.estimate_memory(SHAPE.num_params, N, stage=3, ema=True, offload="optimizer")
    plain = jz.estimate_memory(SHAPE.num_params, N, stage=3, ema=True)
    assert est.host == plain.optimizer + plain.ema == 16 * -(-SHAPE.num_params // N)
    assert plain.total - est.total == est.host and est.optimizer == est.ema == 0
    compiled = _report(3, True, "optimizer").host_argument_bytes
    assert abs(compiled - est.host) <= 0.02 * est.host


def test_gpu_a_dropped_memory_kind_is_an_error(monkeypatch):
    """Compile-only devices drop ``memory_kind`` from a concrete mesh's NamedSharding (it
    comes back None). Pretending the devices report memories (so no abstract-mesh sharding
    is built) shows the check catching it before any state is made."""
    mesh = gpu.compile_only_mesh("h100", N)
    assert offload.memory_kinds(mesh) == ()
    assert (
        NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind="pinned_host").memory_kind
        is None
    )
    monkeypatch.setattr(offload, "memory_kinds", lambda mesh: ("device", "pinned_host"))
    step = _step(2, False, "optimizer")
    with pytest.raises(ValueError, match=r"asked for memory_kind='pinned_host' on the gpu mesh"):
        step.zero.abstract_state(abstract_params(SHAPE), ema=step.ema)


def test_gpu_compile_report_refuses_a_compile_without_the_host_state():
    """The backstop after the compile: an offloading step whose executable takes less from
    the host than its offloaded state (the kinds lost on the way to XLA) is refused."""
    step = _step(2, False, "optimizer")
    state = step.zero.abstract_state(abstract_params(SHAPE), ema=step.ema)
    want = _offloaded_bytes(False)
    assert offload.offloaded_bytes(state) == want
    report._check_host(step, state, {"host_argument": want})  # as compiled: passes
    with pytest.raises(RuntimeError, match=r"takes 0 B from the host: the memory kinds were"):
        report._check_host(step, state, {"host_argument": 0})


def test_gpu_plan_cli_offload_prints_device_and_host_bytes(capsys, monkeypatch):
    # the compile of tests/test_cli_plan_output.py's, test_remainder_plan.py's and
    # test_state_dtype.py's plan too: one process compiles it once
    reuse_gpu_compiles(monkeypatch, H100)
    argv = ["plan", "--devices", "8", "--layers", "2", "--hidden", "256", "--heads", "2"]
    argv += ["--vocab", "512", "--seq", "16", "--stage", "3", "--stage3", "per-layer"]
    assert cli.main([*argv, "--offload", "optimizer", "--wide"]) == 0
    out = capsys.readouterr().out
    assert "offload optimizer to pinned host memory" in out
    header = next(line for line in out.splitlines() if line.startswith("stage"))
    assert "host" in header and "host est." in header
    row = next(line for line in out.splitlines() if line.startswith("3 per layer"))
    est = jz.estimate_memory(SHAPE.num_params, N, stage=3, offload="optimizer").host
    assert est == 12 * -(-SHAPE.num_params // N)  # master + Adam, no EMA in the plan
    assert jz.memory.format_bytes(est) in row


def test_gpu_plan_cli_offload_refuses_stage_0(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(
            ["plan", "--devices", "8", "--params", "1e8", "--stage", "0", "--offload", "optimizer"]
        )
    assert e.value.code == 2
    assert "--offload: offload='optimizer' needs stage 1, 2 or 3" in capsys.readouterr().err
