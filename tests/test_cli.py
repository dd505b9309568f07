"""Tests for the jaxzero command line (jaxzero.cli.main)."""

import argparse
import re

import pytest

from jaxzero import cli, memory
from jaxzero.memory import estimate_memory, format_table, gpt_param_count


def _rows(out):
    """{stage: row fields} from the printed table."""
    rows = {}
    for line in out.splitlines():
        fields = line.split()
        if fields and fields[0] in "0123" and len(fields[0]) == 1:
            rows[int(fields[0])] = fields
    return rows


def test_estimate_all_stages_paper_numbers(capsys):
    assert cli.main(["estimate", "--params", "7.5e9", "--devices", "64"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.strip() == format_table(estimate_memory(7.5e9, 64, gather_model=True))
    rows = _rows(out)
    assert sorted(rows) == [0, 1, 2, 3]
    # total column: ZeRO paper Figure 1 (7.5B, N=64): 120 / 31.4 / 16.6 / 1.9 GB; stage 3's
    # step also holds the model gathered in bf16 (2 x 7.5e9 = 15 GB): 1.88 + 15 GB
    assert [rows[s][-2:] for s in range(4)] == [
        ["120.00", "GB"],
        ["31.41", "GB"],
        ["16.64", "GB"],
        ["16.88", "GB"],
    ]


def test_estimate_gpu_memory_marks_fits(capsys):
    cli.main(["estimate", "--params", "7.5B", "--devices", "64", "--gpu-memory", "32GB"])
    out = capsys.readouterr().out
    rows = _rows(out)
    assert [rows[s][-1] for s in range(4)] == ["NO", "yes", "yes", "yes"]
    assert out.strip().splitlines()[-1] == "fits in 32.00 GB: stage 1, 2, 3"


def test_estimate_gib_budget_and_single_stage(capsys):
    cli.main(
        ["estimate", "--params", "7e9", "--devices", "8", "--stage", "3", "--gpu-memory", "1GiB"]
    )
    out = capsys.readouterr().out
    assert list(_rows(out)) == [3]
    assert "fits in 1.07 GB: no stage" in out  # 2**30 bytes = 1.07 GB


def test_estimate_gpt_model(capsys):
    argv = [
        "estimate",
        "--model",
        "gpt",
        "--layers",
        "32",
        "--hidden",
        "4096",
        "--vocab",
        "32000",
        "--seq-len",
        "2048",
        "--devices",
        "8",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    n = gpt_param_count(32, 4096, vocab=32000, seq=2048)
    assert f"-> {n:,} params" in out
    assert format_table(estimate_memory(n, 8, gather_model=True)) in out


def test_estimate_options_flow_through(capsys):
    argv = [
        "estimate",
        "--params",
        "350M",
        "--devices",
        "4",
        "--optimizer",
        "sgd",
        "--precision",
        "fp32",
        "--ema",
        "--layers",
        "24",
        "--hidden",
        "1024",
        "--heads",
        "16",
        "--batch",
        "2",
        "--seq",
        "512",
        "--ckpt-every",
        "2",
    ]
    cli.main(argv)
    out = capsys.readouterr().out
    expected = estimate_memory(
        350_000_000,
        4,
        optimizer="sgd",
        precision="fp32",
        ema=True,
        layers=24,
        hidden=1024,
        heads=16,
        batch=2,
        seq=512,
        ckpt_every=2,
        gather_model=True,
    )
    assert out.strip() == format_table(expected)
    assert "ema" in out and "activations" in out and "sgd, fp32" in out


def test_estimate_logits_and_layer_params_flow_through(capsys):
    shape = dict(layers=32, hidden=4096, heads=32, batch=1, seq=2048)
    argv = ["estimate", "--params", "6.738B", "--devices", "64", "--stage", "3"]
    argv += ["--precision", "fp32", "--vocab", "32000", "--logits", "--layer-params", "202M"]
    argv += [f"--{k}={v}" for k, v in shape.items()]
    cli.main(argv)
    out = capsys.readouterr().out
    expected = estimate_memory(
        6_738_000_000,
        64,
        stage=3,
        precision="fp32",
        vocab=32000,
        layer_params=202_000_000,
        **shape,
    )
    assert out.strip() == format_table(expected)
    assert "gathered" in out


@pytest.mark.parametrize(
    "argv,match",
    [
        (
            ["estimate", "--params", "7e9", "--devices", "8", "--layer-params", "1e8"],
            "--layer-params needs --layers",
        ),
        (["estimate", "--params", "-5", "--devices", "8"], "--params"),
        (["estimate", "--params", "0", "--devices", "8"], "--params"),
        (["estimate", "--params", "seven", "--devices", "8"], "--params"),
        (["estimate", "--params", "7e9", "--devices", "0"], "--devices"),
        (["estimate", "--params", "7e9", "--devices", "-1"], "--devices"),
        (["estimate", "--params", "7e9"], "--devices"),
        (["estimate", "--devices", "8"], "--params --from-checkpoint --model"),
        (["estimate", "--params", "7e9", "--model", "gpt", "--devices", "8"], "not allowed"),
        (["estimate", "--params", "7e9", "--devices", "8", "--optimizer", "lamb"], "lamb"),
        (["estimate", "--params", "7e9", "--devices", "8", "--precision", "int8"], "int8"),
        (["estimate", "--params", "7e9", "--devices", "8", "--stage", "4"], "--stage"),
        (["estimate", "--params", "7e9", "--devices", "8", "--gpu-memory", "lots"], "lots"),
        (["estimate", "--params", "7e9", "--devices", "8", "--gpu-memory", "80"], "unit"),
        (["estimate", "--model", "gpt", "--layers", "2", "--devices", "8"], "--hidden"),
        (["estimate", "--params", "7e9", "--devices", "8", "--batch", "2"], "--seq, --heads"),
        (
            [
                "estimate",
                "--params",
                "7e9",
                "--devices",
                "8",
                "--layers",
                "2",
                "--hidden",
                "8",
                "--heads",
                "1",
                "--batch",
                "1",
                "--seq",
                "4",
                "--ckpt-every",
                "3",
            ],
            "ckpt_every",
        ),
        ([], "choose a command: estimate"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, match, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "error:" in err and match in err


def test_help_exits_0(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["estimate", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--params",
        "--model",
        "--devices",
        "--stage",
        "--optimizer",
        "--precision",
        "--ema",
        "--gpu-memory",
        "--batch",
        "--seq",
        "--heads",
        "--ckpt-every",
    ):
        assert flag in out
    assert "examples:" in out
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "estimate" in capsys.readouterr().out


def test_registry_accepts_new_subcommands(monkeypatch, capsys):
    monkeypatch.setattr(cli, "COMMANDS", dict(cli.COMMANDS))

    def configure(p):
        p.add_argument("path")

    def run(args, parser):
        if args.path == "bad":
            parser.error("bad path")
        print(f"inspecting {args.path}")
        return 3

    cli.register(cli.Command("frobnicate", "Inspect a checkpoint.", configure, run))
    assert cli.main(["frobnicate", "ckpt/"]) == 3
    assert capsys.readouterr().out == "inspecting ckpt/\n"
    with pytest.raises(SystemExit) as exc:
        cli.main(["frobnicate", "bad"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err == "jaxzero frobnicate: error: bad path (see jaxzero frobnicate --help)\n"
    with pytest.raises(ValueError, match="already registered"):
        cli.register(cli.Command("estimate", "dup", configure, run))
    assert isinstance(cli.build_parser(), argparse.ArgumentParser)


def test_estimate_from_checkpoint(tmp_path, capsys):
    import jax.numpy as jnp
    import optax

    import jaxzero as jz
    from jaxzero import checkpoint

    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)}  # 2,080 params
    zero = jz.ZeRO(optax.adam(1e-3), jz.data_parallel_mesh(8), stage=2)
    checkpoint.save(str(tmp_path), 1, zero.init(params), zero=zero, wait=True)
    assert cli.main(["estimate", "--from-checkpoint", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2,080 params" in out and "stage 2" in out
    want = memory.estimate_memory(2080, 8, stage=2, precision="fp32")
    assert memory.format_bytes(want.total) in out


PLAN_TINY = ["plan", "--devices", "8", "--layers", "2", "--hidden", "128", "--heads", "1"]
PLAN_TINY += ["--vocab", "128", "--seq", "16", "--stage", "3", "--stage3", "per-layer"]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--grad-bits", "4"], r"--grad-bits 4 sets the width of quantized gradients; add "),
        (["--quantize", "weights", "--grad-bits", "4"], r"add --quantize both"),
        (["--quantize", "both", "--grad-bits", "2"], r"argument --grad-bits: invalid choice"),
    ],
)
def test_plan_grad_bits_without_quantized_gradients_is_refused_before_compiling(
    extra, message, capsys
):
    with pytest.raises(SystemExit) as exc:
        cli.main([*PLAN_TINY, *extra])
    assert exc.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_plan_grad_bits_4_plans_deepspeeds_zero_plus_plus_widths(capsys, monkeypatch):
    """`jaxzero plan --quantize both --grad-bits 4` compiles the step with
    Wire.create(weights=8, grads=4) (DeepSpeed's default ZeRO++: int8 weights, int4
    gradients) and says so; its gradients move in one s8 all-to-all per layer."""
    import jaxzero as jz
    from jaxzero import gpu

    seen, real = [], gpu.plan

    def spy(*a, **kw):
        seen.append(a[0].quantize)
        rows = real(*a, **kw)
        seen.append(rows)
        return rows

    monkeypatch.setattr(gpu, "plan", spy)
    assert cli.main([*PLAN_TINY, "--quantize", "both", "--grad-bits", "4"]) == 0
    out = capsys.readouterr().out
    assert "int8 weights and int4 grads on the wire" in out
    wire, (row,) = seen
    assert wire == jz.Wire.create(weights=8, grads=4)
    assert row.report.payload("all-to-all") > 0 and row.report.payload("reduce-scatter") == 0
