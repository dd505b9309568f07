"""A ``ZeRO`` stores its arguments checked and in one spelling, and never rewrites them: the
user's spellings become the canonical fields before the frozen dataclass holds them (for
``ZeRO(...)`` and ``dataclasses.replace`` alike), ``__post_init__`` only checks, and the
objects derived from the fields (placement, activations, comm, gradient path) are built once.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxzero as jz
from jaxzero.zero.config import ZeROConfig

TX = optax.adam(1e-3)

#: (what the user wrote, the fields a ZeRO of it holds), written out by hand.
SPELLINGS = [
    (
        dict(stage=3, layers="layers", offload=["activations", "optimizer"]),
        dict(layers=("layers",), offload="optimizer", offload_activations=True),
    ),
    (
        dict(stage=3, layers=["enc", "dec"], offload="optimizer,params", precision="bf16"),
        dict(
            layers=("enc", "dec"),
            offload=("optimizer", "params"),
            offload_activations=False,
            precision=jz.Precision.create("bf16"),
        ),
    ),
    (
        dict(stage=3, units=r"block_\d+", quantize="both"),
        dict(
            units=(r"block_\d+",),
            prefetch=True,
            quantize=jz.Wire.create(weights=8, grads=8),
            hpz_partition_size=None,
        ),
    ),
    (
        dict(stage=3, layers="layers", hpz_partition_size=2),
        dict(quantize=jz.Wire(hpz=2), hpz_partition_size=2, units=(), prefetch=None),
    ),
    (
        dict(stage=2, offload="optimizer", offload_fraction=1),
        dict(offload="optimizer", offload_fraction=1.0, precision=jz.Precision()),
    ),
    (
        dict(
            stage=3, layers="l", vocab_parallel="embed", quantize=jz.Wire.create(weights=8, hpz=4)
        ),
        dict(vocab_parallel=("embed",), quantize=jz.Wire.create(weights=8, hpz=4)),
    ),
    (
        dict(stage=1, layers=("layers",), hpz_partition_size=1),
        dict(layers=("layers",), vocab_parallel=(), quantize=jz.Wire(), hpz_partition_size=None),
    ),
]


def fields(zero) -> dict:
    return {f.name: getattr(zero, f.name) for f in dataclasses.fields(zero)}


@pytest.fixture(scope="module")
def mesh():
    return jz.data_parallel_mesh()


@pytest.mark.parametrize("given,stored", SPELLINGS)
def test_fields_hold_the_canonical_spelling(mesh, given, stored):
    zero = jz.ZeRO(TX, mesh, **given)
    for name, want in stored.items():
        assert getattr(zero, name) == want, name
        assert type(getattr(zero, name)) is type(want), name


@pytest.mark.parametrize("given,stored", SPELLINGS)
def test_replace_round_trips_and_canonical_input_comes_back_unchanged(mesh, given, stored):
    zero = jz.ZeRO(TX, mesh, **given)
    again = dataclasses.replace(zero)
    assert again == zero and hash(again) == hash(zero) and repr(again) == repr(zero)
    # the canonical fields, given back as arguments, are stored as they are
    assert fields(jz.ZeRO(**fields(zero))) == fields(zero)
    assert fields(again) == fields(zero)


def test_replace_normalizes_a_user_spelling(mesh):
    zero = jz.ZeRO(TX, mesh, stage=3, layers="layers")
    moved = dataclasses.replace(zero, offload=("activations", "optimizer"), layers=["layers"])
    assert moved.offload == "optimizer" and moved.offload_activations is True
    assert moved.layers == ("layers",)
    assert moved == jz.ZeRO(
        TX, mesh, stage=3, layers="layers", offload="optimizer", offload_activations=True
    )


def test_replace_checks_the_combination(mesh):
    zero = jz.ZeRO(TX, mesh, stage=3, quantize="weights")
    with pytest.raises(ValueError, match="stage=3"):
        dataclasses.replace(zero, stage=2)


def test_post_init_rewrites_no_field(mesh, monkeypatch):
    """Every field is the same object before and after ``__post_init__`` (which only checks)."""
    checked = []
    original = ZeROConfig.__post_init__

    def spy(self):
        before = fields(self)
        original(self)
        after = fields(self)
        assert all(after[k] is before[k] for k in before), [
            k for k in before if after[k] is not before[k]
        ]
        checked.append(type(self).__name__)

    monkeypatch.setattr(ZeROConfig, "__post_init__", spy)
    for given, _ in SPELLINGS:
        dataclasses.replace(jz.ZeRO(TX, mesh, **given))
    assert checked == ["ZeRO"] * 2 * len(SPELLINGS)


def test_spellings_of_one_config_are_equal_and_hash_alike(mesh):
    a = jz.ZeRO(TX, mesh, stage=3, layers="layers", offload="activations", precision="fp32")
    b = jz.ZeRO(TX, mesh, stage=3, layers=["layers"], offload_activations=True)
    assert a == b and hash(a) == hash(b) and repr(a) == repr(b)
    assert {a: "a"}[b] == "a"


def test_derived_objects_are_built_once(mesh):
    zero = jz.ZeRO(TX, mesh, stage=3, layers="layers", offload="optimizer")
    for name in ("placement", "activations", "comm", "path"):
        assert getattr(zero, name) is getattr(zero, name), name
    assert zero.path.zero is zero
    assert zero.placement.params_on_host is False and zero.placement.fraction == 1.0


def test_a_copy_is_equal_and_builds_its_own_derived_objects(mesh):
    zero = jz.ZeRO(TX, mesh, stage=2, offload="optimizer")
    zero.path  # noqa: B018 (built on the original before the copy)
    dup = copy.copy(zero)
    assert dup == zero and hash(dup) == hash(zero) and repr(dup) == repr(zero)
    assert dup.path.zero is dup


def test_signature_names_the_fields(mesh):
    names = [f.name for f in dataclasses.fields(jz.ZeRO)]
    params = inspect.signature(jz.ZeRO).parameters
    assert list(params) == names
    assert params["stage"].default == 2 and params["tx"].default is inspect.Parameter.empty
    zero = jz.ZeRO(TX, mesh, 3, "data", layers="layers")  # positional, as the dataclass takes
    assert (zero.stage, zero.axis, zero.layers) == (3, "data", ("layers",))


def test_the_checkpoint_records_the_canonical_offload(mesh):
    given = dict(stage=3, layers="layers", precision="bf16")
    zero = jz.ZeRO(TX, mesh, **given, offload="params , optimizer")
    assert zero.offloaded() == ("optimizer", "params")
    acts = jz.ZeRO(TX, mesh, stage=3, layers="layers", offload="activations")
    assert acts.offloaded() == () and acts.offload_activations is True


# ------------------------------------------- the step's reduction: the path's, not a new config
PARAMS = {
    "layers": {"w": jax.ShapeDtypeStruct((4, 16, 8), jnp.float32)},
    "head": jax.ShapeDtypeStruct((16, 8), jnp.float32),
}


def test_stage1_with_layers_reduces_as_stage2_in_its_path_not_its_config(mesh):
    """A stage-1 step with ``layers=`` and one micro-batch reduce-scatters each layer's
    gradient, as stage 2 does: the step's path says so, and the config stays stage 1."""
    zero = jz.ZeRO(TX, mesh, stage=1, layers="layers")
    stage2 = jz.ZeRO(TX, mesh, stage=2, layers="layers")
    path = zero.path.for_step(1)
    assert path.zero is zero and zero.stage == 1
    assert path.stage == 2 and path.reduces_in_backward() and path.reduces_each_micro_batch()
    assert path.grad_specs(PARAMS) == stage2.grad_specs(PARAMS)
    assert path.grad_specs(PARAMS)["head"] == P("data")  # 16 rows over the 8 devices
    # with micro-batches it keeps one all-reduce of the whole gradient after them
    two = zero.path.for_step(2)
    assert two.stage == 1 and not two.reduces_in_backward() and not two.reduces_each_micro_batch()
    assert jax.tree.leaves(two.grad_specs(PARAMS)) == [P(), P()]
    # a step written by hand from the config's pieces reduces as its stage says
    assert zero.path.stage == 1 and zero.grad_specs(PARAMS) == two.grad_specs(PARAMS)


def test_stage0_with_layers_reduces_each_layer_unless_micro_batches(mesh):
    zero = jz.ZeRO(TX, mesh, stage=0, layers="layers")
    assert zero.path.for_step(1).reduces_in_backward()
    assert not zero.path.for_step(3).reduces_in_backward()
    assert zero.path.reduces_in_backward() and zero.path.for_step(3).zero is zero


def test_the_plan_reads_the_steps_reduction(mesh):
    zero = jz.ZeRO(TX, mesh, stage=1, layers="layers")
    one = {r.path: r for r in zero.plan(PARAMS).rows}
    two = {r.path: r for r in zero.plan(PARAMS, accum_steps=2).rows}
    assert one["layers/w"].reduce == "in_backward" and one["head"].reduce == "reduce_scatter"
    assert two["layers/w"].reduce == "all_reduce" and two["head"].reduce == "all_reduce"
