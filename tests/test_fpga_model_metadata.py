"""What the FPGA backend reads from the model instead of assuming it: RMSNorm epsilon, RoPE base, per-head q/k
norms (a Qwen3 export), the compressed KV cache and the tokens per frame recorded by the compiler.

References: the transformers model the export came from (its config and its own logits), the settings passed to
the compiler, and the bounded-cache arithmetic written out here.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from fastcar_compile.cli import main as cli
from fastcar_compile.core import contract
from fastcar_compile.fpga_backend import compile_to_bundles, encode, isa, load_board
from fastcar_compile.fpga_backend.functional import FunctionalSim, weights_from_onnx
from fastcar_compile.fpga_backend.modelspec import spec_from_onnx
from fastcar_compile.fpga_backend.partition import partition

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

EPS, THETA, FRAME, BUDGET, SINKS, WINDOW = 1e-6, 500000.0, 4, 12, 2, 4


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny Qwen3 (q/k norms, eps 1e-6, RoPE base 5e5) with spread norm scales, exported by dynamo; plus the
    FastCar compile of it with and without a compressed KV cache."""
    import fastcar_compile as fc
    from fastcar_compile.export import export_decoder

    cfg = tf.Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=100, rms_norm_eps=EPS, rope_theta=THETA,
                         max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # the defaults (all ones) would hide a norm applied with the wrong scale
                p.add_(0.3 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("qwen3")
    plain = export_decoder(model, d / "plain.onnx")
    fast, kv = d / "fast.onnx", d / "kv.onnx"
    fc.compile(str(plain), str(fast), frame_tokens=FRAME, threshold=0.0)
    fc.compile(str(plain), str(kv), frame_tokens=FRAME, threshold=0.0, kv_budget=BUDGET, kv_sinks=SINKS,
               kv_window=WINDOW)
    return model, plain, fast, kv


def _per_head_norms(program) -> np.ndarray:
    core = program.bundles[:, :-1]
    return (core["opcode"] == isa.Op.VEC) & (core["sub"] == isa.Vec.RMSNORM) & (core["n"] > 1)


def test_eps_rope_base_and_qk_norm_come_from_the_graph(qwen3):
    model, plain, fast, _ = qwen3
    cfg = model.config
    for path in (plain, fast):
        spec, notes = spec_from_onnx(path)
        assert spec.rms_eps == pytest.approx(cfg.rms_norm_eps, rel=1e-6)
        assert spec.rope_theta == pytest.approx(cfg.rope_parameters["rope_theta"], rel=1e-5)
        assert spec.qk_norm
    report = compile_to_bundles(fast, None)
    assert report.model["rms_eps"] == pytest.approx(EPS, rel=1e-6) and report.model["qk_norm"]
    program = encode.decode(encode.encode(_program(fast)))
    assert _per_head_norms(program).any(axis=1).sum() == 2 * cfg.num_hidden_layers  # q and k, every layer
    names = {t["name"]: t["source"] for t in program.meta["tensors"]}
    for layer in range(cfg.num_hidden_layers):
        assert names[f"L{layer}.q_norm"] == f"m.model.layers.{layer}.self_attn.q_norm.weight"
        assert names[f"L{layer}.k_norm"] == f"m.model.layers.{layer}.self_attn.k_norm.weight"


def _program(path, **kw):
    from fastcar_compile.fpga_backend import build_program

    return build_program(path, load_board("kv260"), **kw)


def test_functional_mode_of_the_plain_export_matches_transformers(qwen3):
    """The dense program of the plain export, run on the export's own weights, gives transformers' logits: eps,
    RoPE base and the per-head q/k norms are the model's."""
    model, plain, _, _ = qwen3
    batch, steps = 2, 6
    program = _program(plain, batch=batch, context=steps)
    w, emb = weights_from_onnx(program, str(plain))
    sim = FunctionalSim(program, w, max_context=steps)
    ids = torch.from_numpy(np.random.default_rng(3).integers(0, model.config.vocab_size, (batch, steps)))
    cache = tf.DynamicCache(config=model.config)
    with torch.no_grad():
        for pos in range(steps):
            out = model(input_ids=ids[:, pos : pos + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            got = sim.step(emb[ids[:, pos].numpy()], pos)["logits"]
            np.testing.assert_allclose(got, out.logits[:, -1].double().numpy(), rtol=1e-4, atol=1e-4)


def test_plain_export_compiles_to_a_dense_baseline(qwen3, tmp_path, capsys):
    _, plain, fast, _ = qwen3
    dense, fcb = tmp_path / "dense.fcb", tmp_path / "fast.fcb"
    assert cli([str(plain), "--target", "fpga", "--context", "16", "-o", str(dense)]) == 0
    program = encode.load(dense)
    ops = program.bundles["opcode"]
    assert not np.isin(ops, [isa.Op.TAS, isa.Op.XCHG, isa.Op.DRS_SET, isa.Op.DRS_DISPATCH]).any()
    assert not (program.bundles["flags"] & isa.Flag.SKIP_ON_REPLAY).any()
    assert program.meta["model"]["replay_layers"] == [] and program.meta["model"]["frame_tokens"] is None
    assert cli([str(fast), "--target", "fpga", "--context", "16", "-o", str(fcb)]) == 0
    capsys.readouterr()
    assert cli(["sim", str(fcb), "--baseline", str(dense), "--replay-ratio", "0.5", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["static_x_dense"] > 1.0  # replaying half the MLPs beats the dense program of the same model


def test_frame_tokens_are_never_assumed(qwen3, tmp_path, capsys):
    """A plain export records no tokens per frame: the default context (2 x L) needs --frame-tokens or --context;
    a compiled model's own L is not overridden by a different flag."""
    _, plain, fast, _ = qwen3
    out = tmp_path / "p.fcb"
    capsys.readouterr()
    assert cli([str(plain), "--target", "fpga", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--context" in err and "--frame-tokens" in err and not out.exists()
    assert cli([str(plain), "--target", "fpga", "--frame-tokens", "6", "-o", str(out)]) == 0
    assert encode.load(out).meta["context"] == 12
    assert cli([str(fast), "--target", "fpga", "--frame-tokens", "6", "-o", str(tmp_path / "f.fcb")]) == 2
    err = capsys.readouterr().err
    assert f"frame_tokens {FRAME}" in err and not (tmp_path / "f.fcb").exists()


def test_qk_norms_the_backend_cannot_place_are_listed_with_their_cost(qwen3):
    """A [head_dim] norm scale more than 2 per layer: not modelled, so named in `unsupported` with its cost."""
    _, plain, _, _ = qwen3
    proto = onnx.load(str(plain), load_external_data=False)
    extra = onnx.numpy_helper.from_array(np.ones(16, np.float32), "extra_head_scale")
    proto.graph.initializer.append(extra)
    proto.graph.node.append(onnx.helper.make_node("Mul", ["extra_head_scale", "extra_head_scale"], ["extra_out"]))
    part = partition(proto, load_board("kv260"), frame_tokens=FRAME)
    assert not part.spec.qk_norm
    assert any(u.startswith("q/k norm (5 [head_dim]") and "cycles" in u for u in part.unsupported), part.unsupported


def test_kv_settings_are_read_from_the_model(qwen3):
    _, _, _, kv = qwen3
    meta = contract.FastCarMetadata.from_props({p.key: p.value for p in onnx.load(str(kv),
                                                load_external_data=False).metadata_props})
    layers = sorted(meta.kv_layer_settings())
    assert layers
    program = _program(kv)
    assert program.meta["kv"] == {str(n): {"budget": BUDGET, "sinks": SINKS, "window": WINDOW} for n in layers}


def test_per_layer_kv_settings_reach_their_layers(qwen3, tmp_path):
    """--kv-layer: layer 1 bounded with its own settings and TempCache merging, layer 0 dense; the bundle
    records exactly that, and the report notes that merging is not priced."""
    import fastcar_compile as fc

    _, plain, _, _ = qwen3
    mixed = tmp_path / "mixed.onnx"
    fc.compile(str(plain), str(mixed), frame_tokens=FRAME, threshold=0.0,
               kv_layers=["0:off", "1:budget=10,sinks=1,window=4,tempcache=0.9"])
    report = compile_to_bundles(mixed, tmp_path / "mixed.fcb")
    assert encode.load(tmp_path / "mixed.fcb").meta["kv"] == {"1": {"budget": 10, "sinks": 1, "window": 4}}
    assert any("TempCache merging" in n and "not priced" in n for n in report.notes), report.notes


def _sim(capsys, fcb, *extra):
    capsys.readouterr()
    rc = cli(["sim", str(fcb), "--context", "40", "--steps", "2", "--policy", "static", "--json", *extra])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)["static"], out.err


def test_sim_uses_the_recorded_kv_cache_and_flags_only_override_saying_so(qwen3, tmp_path, capsys):
    _, _, fast, kv = qwen3
    dense_fcb, kv_fcb = tmp_path / "dense_kv.fcb", tmp_path / "kv.fcb"
    compile_to_bundles(fast, dense_fcb)
    compile_to_bundles(kv, kv_fcb)
    full, err_full = _sim(capsys, dense_fcb)
    recorded, err_recorded = _sim(capsys, kv_fcb)
    assert err_full == "" and err_recorded == ""
    # K and V reads shrink from the context (40) to the budget in every bounded layer; writes are unchanged
    spec = encode.load(kv_fcb).meta["model"]
    kv_dim = spec["kv_heads"] * spec["head_dim"]
    want = 2 * spec["layers"] * (40 - BUDGET) * kv_dim * spec["dtype_bytes"]
    got = full["dram_bytes_per_step"]["kv"] - recorded["dram_bytes_per_step"]["kv"]
    assert got == pytest.approx(want)
    same, err_same = _sim(capsys, kv_fcb, "--kv-budget", str(BUDGET), "--kv-sinks", str(SINKS),
                          "--kv-window", str(WINDOW))
    assert same["cycles_per_step"] == pytest.approx(recorded["cycles_per_step"])
    other, err_other = _sim(capsys, kv_fcb, "--kv-budget", "30")
    for err in (err_same, err_other):
        assert len(err.strip().splitlines()) == 1 and err.startswith("note: --kv-* override") and \
            f"{BUDGET} slots" in err
    assert other["dram_bytes_per_step"]["kv"] - recorded["dram_bytes_per_step"]["kv"] == \
        pytest.approx(2 * spec["layers"] * (30 - BUDGET) * kv_dim * spec["dtype_bytes"])
    _, err_dense = _sim(capsys, dense_fcb, "--kv-budget", "30")
    assert "override" in err_dense and "(dense)" in err_dense
