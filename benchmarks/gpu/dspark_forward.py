"""Where a DSpark draft forward's time goes, and what dense weights buy (issue #5, GPU).

Starts the engine with the shipped drafter, takes the tapped target states of a workload prompt,
then times steady compiled draft forwards (7 drafts, greedy, the context already absorbed) of
several weight variants side by side, each split into cumulative stages:

* ``network``: the block through the draft layers (``h`` ``[7, d]``);
* ``lm_head``: + the LM head and a plain argmax (no Markov head);
* ``draft``: the engine's whole draft (:meth:`DraftStep.draft`: + Markov loop, confidence);
* ``absorb``: the context update of 1-4 new rows (separately).

Variants: the engine's quantized network through MLX ops (``mlx_ops``) or through the one-launch
block forward (``fused``: ``metal_kernels.fused.DraftFusedPass``, CUDA), both over the engine's
draft vocabulary when the drafter has one (then ``mlx_ops_whole_vocab`` too), and the network
dequantized to float32 / bfloat16 with a dense dequantized LM head (MLX ops). Medians of wall
time per call including one host round trip (``mx.eval`` + ``tolist``), the way the engine pays.

    python -m benchmarks.gpu.dspark_forward --iters 200 --out dspark_forward.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx

from benchmarks.bench_speculative import load_workloads, prompt_tokens
from drafters.base import DraftContext
from drafters.dspark import DraftStep, DSparkDrafter, load_dspark
from drafters.dspark.model import block_inputs
from engine import Engine, EngineConfig
from engine.loader import default_dspark_path


def _timed(fn, iters: int) -> float:
    times = []
    for i in range(iters + 5):
        started = time.perf_counter()
        out = fn()
        mx.eval(out)
        out.tolist() if out.size < 64 else out[:1].tolist()
        if i >= 5:
            times.append(1e3 * (time.perf_counter() - started))
    return round(statistics.median(times), 4)


def dense_head(lm_head, d: int, dtype):
    """The LM head as a dense ``[d, V]`` matrix of ``dtype`` (exact: ``lm_head(I)``)."""
    w = lm_head(mx.eye(d, dtype=mx.float32)).astype(dtype)
    mx.eval(w)
    return lambda h: h.astype(dtype) @ w


def profile(net, embed, lm_head, hidden, tokens, pos: int, iters: int, fused=None, vocab=None) -> dict:
    cfg = net.config
    step = DraftStep(net, embed, lm_head, fused=fused, vocab=vocab)
    head = vocab.head if vocab is not None else lm_head  # (logits over the draft vocabulary)
    d = DSparkDrafter(net, embed, lm_head, step)
    d.propose(DraftContext(tokens[: pos + 1], hidden[:pos]), 7)  # absorbs the prompt
    keys, values = d._keys, d._values
    anchor, apos = mx.array([tokens[pos]], dtype=mx.int32), mx.array([pos], dtype=mx.int32)

    def network_fn(anchor, apos, keys, values):
        if fused is not None:
            x = block_inputs(embed, anchor, cfg.mask_token_id, cfg.block_size)[0, 0]
            return fused(x, keys, values, pos).hidden[-1]
        x = block_inputs(embed, anchor, cfg.mask_token_id, cfg.block_size)
        visible = (mx.arange(keys[0].shape[2]) < apos)[None, None]
        return net(x, apos.reshape(1, 1), list(zip(keys, values)), visible, fast=True)[0, 0]

    def head_fn(*a):
        if fused is not None:
            x = block_inputs(embed, anchor, cfg.mask_token_id, cfg.block_size)[0, 0]
            return mx.argmax(fused(x, keys, values, pos).logits, axis=-1)
        return mx.argmax(head(network_fn(*a)).astype(mx.float32), axis=-1)

    net_c = network_fn if fused is not None else mx.compile(network_fn)
    head_c = head_fn if fused is not None else mx.compile(head_fn)
    out = {
        "network_ms": _timed(lambda: net_c(anchor, apos, keys, values), iters),
        "lm_head_ms": _timed(lambda: head_c(anchor, apos, keys, values), iters),
        "draft_ms": _timed(lambda: step.draft(tokens[pos], pos, keys, values, 7, 0.0, 0)[0], iters),
    }
    absorb = []
    for i in range(iters + 5):
        new = 1 + i % 4
        started = time.perf_counter()
        k2, v2 = step.absorb(hidden[pos : pos + new], pos, keys, values)
        mx.eval(k2, v2)
        k2[0][0, 0, 0, :1].tolist()
        if i >= 5:
            absorb.append(1e3 * (time.perf_counter() - started))
    out["absorb_ms"] = round(statistics.median(absorb), 4)
    out["drafts"] = step.draft(tokens[pos], pos, keys, values, 7, 0.0, 0)[0].tolist()
    return out


def launch_breakdown(net, target, taps, hidden, tokens, pos: int, iters: int, vocab=None,
                     block_counts: tuple[int, ...] = (), blocks_only: bool = False) -> dict:
    """Median ms of one evaluated fused launch of the default kernel (``max_rows``/``warps`` in
    the result: 8 rows since the fifty-first session, 16 before) with phases left out (``skip``: the layers' five
    phases 1..16, the LM head 32): every phase, no LM head, nothing (launch + barriers), the
    greedy draft inside the launch on top of everything, and that with 3 context rows projected
    into the draft cache first (a steady cycle's update); then the greedy draft of the 16-row
    kernel (8 warps) and the 8-row one (8 and 16 warps) with 0..64 new context rows, as many as
    each takes (``rows{kernel rows}_w{warps}_greedy_draft_{context rows}_new_rows``); with the
    drafter's draft ``vocab``, the same kernels over its ``V'`` rows with 0 and 3 new rows
    (``..._vocab{V'}_greedy_draft_...``), and the cycle profile over both; for each of
    ``block_counts``, the engine's kernel (its rows and warps, over ``vocab``) launched on that
    many blocks instead of one per multiprocessor (``blocks{n}_greedy_draft_3_new_rows``: fewer
    blocks wait less at each grid barrier and each does more of every phase's work), first;
    ``blocks_only``: nothing else (each other kernel is a compile of its own)."""
    from metal_kernels.fused import DraftFusedPass

    cfg = net.config
    d = DSparkDrafter(net, taps.embed, taps.lm_head, DraftStep(net, taps.embed, taps.lm_head))
    d.propose(DraftContext(tokens[: pos + 1], hidden[:pos]), 7)
    keys, values = d._keys, d._values
    anchor = mx.array([tokens[pos]], dtype=mx.int32)
    x0 = block_inputs(taps.embed, anchor, cfg.mask_token_id, cfg.block_size)[0, 0].astype(mx.float32)
    mx.eval(x0)
    rows = hidden[pos - 3:pos]  # (rewriting rows the cache already holds: the same values)
    default = DraftFusedPass(net, target, vocab=vocab)  # (the engine's kernel: its rows, warps, blocks)
    out = {"default_blocks": default.blocks, "default_warps": default.warps, "default_max_rows": default.max_rows}
    for blocks in block_counts:  # (keyed by the count asked for: more than one per SM is capped)
        fp = DraftFusedPass(net, target, blocks=blocks, rows=default.max_rows, warps=default.warps, vocab=vocab)
        out[f"blocks{blocks}_greedy_draft_3_new_rows"] = _timed(
            lambda fp=fp: fp(x0, keys, values, pos, anchor, rows).tokens, iters)
        out[f"blocks{blocks}_launched"] = fp.blocks
    if blocks_only:
        return out
    for name, skip, greedy, new in (("all_phases", 0, False, None), ("no_lm_head", 32, False, None),
                                    ("no_attention", 2, False, None), ("barriers_only", 63, False, None),
                                    ("greedy_draft", 0, True, None), ("greedy_draft_3_new_rows", 0, True, rows)):
        fp = DraftFusedPass(net, target, skip=skip)
        if greedy:
            out[name] = _timed(lambda fp=fp, new=new: fp(x0, keys, values, pos, anchor, new).tokens, iters)
        else:
            out[name] = _timed(lambda fp=fp: fp(x0, keys, values, pos).errors, iters)
    for kernel_rows, warps in ((16, 8), (8, 8), (8, 16)):  # the kernels; 8 rows: context rows in chunks
        try:
            fp = DraftFusedPass(net, target, warps=warps, rows=kernel_rows)
        except ValueError as exc:  # (16 warps that do not fit this drafter)
            out[f"rows{kernel_rows}_w{warps}"] = str(exc)
            continue
        for new in (0, 3, 16, 20, 64):
            if new > min(fp.max_absorb, pos):
                continue
            more = hidden[pos - new:pos] if new else None
            out[f"rows{kernel_rows}_w{warps}_greedy_draft_{new}_new_rows"] = _timed(
                lambda fp=fp, more=more: fp(x0, keys, values, pos, anchor, more).tokens, iters)
    if vocab is not None:  # the two vocabulary-wide phases over V' rows instead of V
        for kernel_rows, warps in ((16, 8), (8, 16)):
            try:
                fp = DraftFusedPass(net, target, warps=warps, rows=kernel_rows, vocab=vocab)
            except ValueError:
                continue
            for new in (0, 3):
                more = hidden[pos - new:pos] if new else None
                out[f"rows{kernel_rows}_w{warps}_vocab{vocab.size}_greedy_draft_{new}_new_rows"] = _timed(
                    lambda fp=fp, more=more: fp(x0, keys, values, pos, anchor, more).tokens, iters)
    fp = DraftFusedPass(net, target)
    out["warps"], out["max_rows"], out["blocks"] = fp.warps, fp.max_rows, fp.blocks
    build, wait = [], []
    for i in range(iters + 5):  # host time to build the launch vs its evaluation (device + sync)
        started = time.perf_counter()
        res = fp(x0, keys, values, pos, anchor, rows)
        built = time.perf_counter()
        mx.eval(res.tokens, res.errors)
        res.tokens.tolist()
        if i >= 5:
            build.append(1e3 * (built - started))
            wait.append(1e3 * (time.perf_counter() - built))
    out["greedy_draft_3_new_rows_build"] = round(statistics.median(build), 4)
    out["greedy_draft_3_new_rows_eval"] = round(statistics.median(wait), 4)
    out["profile_cycles"] = draft_profile(DraftFusedPass(net, target, profile=True), x0, keys, values, pos, anchor, rows)
    if vocab is not None:
        out[f"profile_cycles_vocab{vocab.size}"] = draft_profile(
            DraftFusedPass(net, target, profile=True, vocab=vocab), x0, keys, values, pos, anchor, rows)
    return out


def draft_profile(fp, x0, keys, values, pos, anchor, rows) -> dict:
    """SM cycles per phase of the greedy draft launch with 3 context rows (the kernel's clock64()
    marks, medians over 9 launches; ``fused_probe.phase_cycles``). The context update and layer
    0's A share a slot; A2 (q/k norm) is in B."""
    import numpy as np

    from benchmarks.gpu.fused_probe import phase_cycles

    samples = []
    for i in range(12):
        res = fp(x0, keys, values, pos, anchor, rows)
        mx.eval(res.tokens, res.errors, res.profile)
        if i >= 3:
            samples.append(np.array(res.profile).astype(np.float64))
    return phase_cycles(samples, ("A_absorb_norm_qkv", "B_qknorm_attention", "C_o_proj", "D_norm_gate_up", "E_down"))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="novel_code")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-dense", action="store_true", help="skip the dense-weight variants")
    ap.add_argument("--blocks", default="",
                    help="comma-separated block counts to launch the draft kernel on (empty: none)")
    ap.add_argument("--launch-only", action="store_true", help="only the launch breakdown (no variants)")
    ap.add_argument("--blocks-only", action="store_true", help="only the block-count sweep (--blocks)")
    args = ap.parse_args(argv)
    if args.blocks_only and not args.blocks:
        ap.error("--blocks-only needs --blocks")
    args.launch_only = args.launch_only or args.blocks_only
    eng = Engine(EngineConfig(speculation="dspark", dspark=True)).start(wait=True)
    try:
        taps, tok = eng.target_taps, eng.loaded.tokenizer
        prompt = next(p for w in load_workloads([args.workload]) for p in w["prompts"]
                      if p.get("kind") != "session")
        tokens = prompt_tokens(tok, prompt)
        tokens = (tokens * 4)[: len(tokens) + 64]
        hidden = taps.forward(mx.array(tokens)[None])[1][0]
        mx.eval(hidden)
        pos = len(tokens) - 32
        path = eng.config.dspark_drafter or default_dspark_path(eng.loaded)
        d = eng.dspark.config.hidden_size
        vocab = eng.draft_vocab  # (the engine's: the drafter's draft vocabulary, unless turned off)
        variants = [("mlx_ops", eng.dspark, taps.lm_head, None, vocab),
                    ("fused", eng.dspark, taps.lm_head, eng._dspark_step.fused, vocab)]
        if vocab is not None:
            variants.append(("mlx_ops_whole_vocab", eng.dspark, taps.lm_head, None, None))
        for name, dtype in () if args.no_dense or args.launch_only else (("dense_f32", "float32"), ("dense_bf16", "bfloat16")):
            net = load_dspark(path, dtype=dtype, dequantize=True)
            variants.append((f"{name}+dense_head", net, dense_head(taps.lm_head, d, net.fc_dtype), None, None))
        report = {"T1_ms": round(eng.cost.verify_cost[0] * 1e3, 4), "context": pos, "variants": {}}
        if eng._dspark_step.fused is not None:
            report["launch"] = launch_breakdown(eng.dspark, eng.loaded.model, taps, hidden, tokens, pos, args.iters,
                                                vocab, tuple(int(b) for b in args.blocks.split(",") if b),
                                                args.blocks_only)
            print("launch", json.dumps(report["launch"]), flush=True)
        for key, net, head, fused, dv in () if args.launch_only else variants:
            if key == "fused" and fused is None:
                continue  # (not on this machine)
            report["variants"][key] = profile(net, taps.embed, head, hidden, tokens, pos, args.iters, fused, dv)
            print(key, json.dumps(report["variants"][key]), flush=True)
    finally:
        eng.stop()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
