"""Sweep the tensor-core (mma) kernel's split per weight shape: time per matmul at M = 1, 8, 16.

For each 4-bit shape, every launchable (WK warps splitting K, NT 16-row tiles per warp, U chunks
in flight) is timed against ``mx.quantized_matmul`` in one run; each timed graph runs the matmul
over enough distinct weight sets (>= 256 MB) that L2 never holds them; the median of --reps
gives microseconds per matmul (wall time of the graph / matmuls, launch gaps included).
Effective bandwidth = packed weight + scale + bias bytes / time. WK changes a row's reduction
order (fixed per shape, for every M); NT and U do not.

    PYTHONPATH=$PWD python benchmarks/gpu/mma_sweep.py --out mma_sweep.json

Wall time on MLX-CUDA is bound by the host's cost per custom-kernel call (~18 us), so device
time comes from Nsight Compute: ``--ncu`` launches MLX's path, the default plan and every
configuration (``--wk/--nt/--u`` narrow the sweep) twice at each of ``--rows`` in a printed
order, and ``--parse CSV`` pairs ncu's CSV with that order:

    ncu --clock-control none --kernel-name regex:"qmv|qmm|specserve" --metrics gpu__time_duration.sum \
        --csv --log-file ncu.csv python benchmarks/gpu/mma_sweep.py --ncu > order.txt  # a case per line
    PYTHONPATH=$PWD python benchmarks/gpu/mma_sweep.py --parse ncu.csv --order order.txt --out mma_ncu.json

``--configs "WK,NT,U,KC,XL,LB[,MR,FU,LP,XS];..."`` times those launch configurations instead (see
``CONFIG_FIELDS``); ``--regs`` compiles the same cases with the local CUDA toolkit (no GPU) and
prints their registers and spills, to keep unlaunchable ones out of a sweep.

``--floor`` sums a float32 array of each shape's weight bytes twice (``mx.sum``): under
``ncu --kernel-name regex:all_reduce`` that is how long MLX's tuned reduction takes to read the
same bytes (a reference, not a bound on what a kernel can reach), and its second stage (a ~10 KB
read) what one small launch costs.
"""

from __future__ import annotations

import argparse
import itertools
import json

import mlx.core as mx

from benchmarks.verify_cost import _median_time, _nbytes, _weight_sets
from metal_kernels import plan, qmv, quantized_matmul

SHAPES = ((4096, 4096, 64), (14336, 4096, 64), (4096, 14336, 64), (49152, 576, 32))


def time_us(sets, m, k, gs, dtype, kernels, reps):
    x = mx.random.normal((m, k)).astype(dtype)
    mx.eval(x)
    fn = lambda: [quantized_matmul(x, w, s, b, gs, 4, kernels=kernels) for w, s, b in sets]  # noqa: E731
    return _median_time(fn, reps) / len(sets) * 1e6


def _configs(n, k, gs, dtype, mb=None, wks=(1, 2, 4, 8, 16), nts=(1, 2, 4), us=(1, 2, 4)):
    """(WK, NT, U) the kernel can take for this shape (and that fit at row bucket ``mb``)."""
    p1 = plan(1, n, k, 4, gs, dtype, "cuda")
    nchunks = k // (4 * p1.const("VW") * 32 // 4)
    for wk, nt, u in itertools.product(wks, nts, us):
        if wk <= nchunks and not n % (16 * nt) and (mb is None or qmv.mma_config_fits(nt, u, mb, wk)):
            yield wk, nt, u


# A case's configuration: (WK, NT, U, KC, XL, LB, MR, FU, LP, XS) = warps splitting K, tiles
# per warp, chunks in flight, K as a compile-time constant, activations loaded late, launch
# bounds' minimum blocks per multiprocessor (0: none), the row count fixed at compile time (1:
# every row count, 0: none), the compile-time-shape loop unrolled (-1 for these two: the plan's
# choice, the row count fixed for one row only), an L2 prefetch-size hint in bytes on the
# weight loads (0: none), one fixed row's activations held two registers per lane and shuffled
# (1; with KC, one row). Only WK changes a row's arithmetic. --configs may leave out trailing
# fields after the first six (they then take CONFIG_TAIL: the plan's choices, no hint, no
# shuffle). (The twenty-fifth session's first sweep had a PN field, since removed.)
CONFIG_FIELDS = ("WK", "NT", "U", "KC", "XL", "LB", "MR", "FU", "LP", "XS")
CONFIG_TAIL = (-1, -1, 0, 0)  # MR, FU, LP, XS where --configs leaves them out


def apply_config(n, k, m, cfg, multi_row_only=False):
    """Install one configuration for the (n, k) 4-bit shape at m rows (qmv.set_mma_config);
    ``multi_row_only``: an 8-row-bucket configuration leaves one-row launches to the defaults."""
    wk, nt, u, kc, xl, lb, mr, fu, lp, xs = cfg
    mb = 8 if m <= 8 else 16
    opts = {"const_shape": bool(kc), "xl": bool(xl), "min_blocks": lb, "exact": True, "l2_prefetch": lp,
            "x_shuffle": bool(xs), "multi_row_only": bool(multi_row_only)}
    for key, v in (("fixed_rows", mr), ("unroll", fu)):
        if v >= 0:
            opts[key] = bool(v)
    qmv.set_mma_config(n, k, 4, wk=wk, nt_u={mb: (nt, u)}, path={mb: opts})


def case_list(n, k, gs, dtype, rows, wks, nts, us, configs):
    """(path, rows, config) cases: MLX's matmul and the default plan at each row count, then
    ``configs`` (a negative WK: the default plan's WK), or the --wk/--nt/--u product that fits
    (with the default plan's compile-time-shape choice)."""
    cases = [(path, m, None) for m in rows for path in ("mlx", "default")]
    if configs:
        wk0 = plan(1, n, k, 4, gs, dtype, "cuda").const("WK")
        return cases + [("config", m, (wk0 if c[0] < 0 else c[0], *c[1:])) for m in rows for c in configs]
    return cases + [("config", m, (*c, int(qmv.CONST_SHAPE), 0, 0, *CONFIG_TAIL)) for m in rows
                    for c in _configs(n, k, gs, dtype, 8 if m <= 8 else 16, wks, nts, us)]


def ncu_run(dtype, wks, nts, us, rows, shapes=SHAPES, configs=(), launches=2):
    """``launches`` (>= 2) launches per case (ncu flushes L2 between kernels; the first one
    warms up, the median of the others is the case's time); prints the case order, one
    case per line as it runs (so a run cut short still parses). A case's config is
    :data:`CONFIG_FIELDS` (``configs``: these for every row count, else the product of
    ``wks`` x ``nts`` x ``us`` that fits)."""
    for n, k, gs in shapes:
        w = _weight_sets(n, k, 4, gs, dtype, 1)[0]
        for path, m, cfg in case_list(n, k, gs, dtype, rows, wks, nts, us, configs):
            x = mx.random.normal((m, k)).astype(dtype)
            mx.eval(x)
            if cfg:
                apply_config(n, k, m, cfg)
            for _ in range(launches):
                mx.eval(quantized_matmul(x, *w, gs, 4, kernels="off" if path == "mlx" else "auto"))
            mx.synchronize()
            qmv.clear_mma_config()
            print("NCU_CASE " + json.dumps({"shape": f"{n}x{k}", "group_size": gs, "weight_bytes": _nbytes(*w),
                                            "path": path, "m": m, "config": cfg, "launches": launches}), flush=True)


def regs_run(dtype, wks, nts, us, rows, shapes=SHAPES, configs=()):
    """Compile every case's kernel for sm_90 with the local CUDA toolkit (no GPU) and print its
    registers, spills and whether it launches: what to keep out of a sweep before spending
    device time (a kernel over the multiprocessor's registers fails to launch)."""
    from metal_kernels.cuda_source import MLX_PRELUDE, ptxas_usage, render_qmv

    src, names = MLX_PRELUDE, []
    for n, k, gs in shapes:
        for path, m, cfg in case_list(n, k, gs, dtype, rows, wks, nts, us, configs):
            if path != "config":
                continue
            apply_config(n, k, m, cfg)
            p = plan(m, n, k, 4, gs, dtype, "cuda")
            qmv.clear_mma_config()
            names.append((f"r{len(names)}", n, k, m, cfg, p))
            src += render_qmv(p, dtype, dtype, names[-1][0])
    usage = ptxas_usage(src)
    for name, n, k, m, cfg, p in names:
        u = usage[name]
        got = (p.const("WK"), p.const("NT"), p.const("U"), int(p.const("KC") > 0), p.const("XL"), p.min_blocks,
               p.const("MR"), p.const("FU"), p.const("LP"), p.const("XS"))
        want = (*cfg[:6], m if cfg[6] == 1 else 0 if cfg[6] == 0 else got[6],
                got[7] if cfg[7] < 0 else cfg[7], cfg[8], cfg[9] if got[6] == 1 and cfg[3] else 0)
        fits = qmv.registers_fit(u["registers"], p.threadgroup[0], p.min_blocks)
        print(f"{n}x{k} M={m} {cfg}: {u['registers']} registers, spills {u['spill_stores']}/{u['spill_loads']} B"
              f"{'' if fits else ', DOES NOT LAUNCH'}{'' if got == want else f', plan gave {got}'}")


def floor_run(dtype, shapes=SHAPES):
    """``mx.sum`` over float32 arrays of each shape's packed weight + scale + bias bytes (scales
    and biases in ``dtype``, as the sweep builds them), twice."""
    for n, k, gs in shapes:
        nbytes = _nbytes(*_weight_sets(n, k, 4, gs, dtype, 1)[0])
        a = mx.random.uniform(shape=(nbytes // 4,))
        mx.eval(a)
        for _ in range(2):
            mx.eval(mx.sum(a))
        mx.synchronize()
        print(f"FLOOR {n}x{k} {nbytes} bytes", flush=True)


def parse(csv_path, order_path, out):
    """Device time per case (us): the median of its launches after the first (one launch when
    the run had two per case), from ncu's CSV; ``us_all``: those launches' times."""
    import csv
    import statistics
    lines = open(order_path).read().splitlines()
    order = [json.loads(line[9:]) for line in lines if line.startswith("NCU_CASE ")]
    order += [c for line in lines if line.startswith("NCU_ORDER ") for c in json.loads(line[10:])]  # older runs
    times = [(r["Kernel Name"], float(r["Metric Value"].replace(",", "")), r["Metric Unit"])
             for r in csv.DictReader(line for line in open(csv_path) if not line.startswith("=="))
             if r.get("Metric Name") == "gpu__time_duration.sum"]
    starts = [0]
    for case in order:
        starts.append(starts[-1] + case.get("launches", 2))
    # (a run cut short: cases are printed after their launches, so ncu may hold a few more)
    assert len(times) >= starts[-1], (len(times), starts[-1])
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
    for i, case in enumerate(order):  # a case's launches are one kernel (else the pairing shifted)
        own = times[starts[i]:starts[i + 1]]
        if len({name for name, _, _ in own}) != 1:
            raise SystemExit(f"case {i} ({case}): its launches ran different kernels; "
                             "the CSV and the case order do not pair")
        case["us_all"] = [value * scale[unit] for _, value, unit in own[1:]]
        case["us"], case["kernel"] = statistics.median(case["us_all"]), own[0][0].split("(")[0]
        case["tbs"] = case["weight_bytes"] / case["us"] / 1e6
    json.dump(order, open(out, "w"), indent=1)
    for shape in dict.fromkeys(c["shape"] for c in order):
        cs = [c for c in order if c["shape"] == shape]
        for m in sorted({c["m"] for c in cs}):
            at = [c for c in cs if c["m"] == m]
            mlx = next((c for c in at if c["path"] == "mlx"), None)
            default = next((c for c in at if c["path"] == "default"), None)
            best = min((c for c in at if c["path"] != "mlx"), key=lambda c: c["us"])
            print(f"{shape} M={m}: mlx {mlx and round(mlx['us'], 2)} default {default and round(default['us'], 2)}"
                  f"; best {best['path']} {best['config']} {best['us']:.2f} us ({best['tbs']:.2f} TB/s"
                  + (f", {mlx['us'] / best['us']:.2f}x MLX)" if mlx else ")"))
            for c in sorted((c for c in at if c["path"] == "config"), key=lambda c: c["us"])[:4]:
                print(f"    {c['config']} {c['us']:.2f} us" + (f" ({mlx['us'] / c['us']:.2f}x MLX)" if mlx else ""))


def pick(paths, margin, out_path):
    """From parsed sweeps (``--parse`` output; one or more files), the configuration per shape
    and row bucket (8: M <= 8, 16: M > 8) whose Nsight median beats the default plan's at the
    same row count by more than ``margin`` (a fraction); written as ``{"NxK:GROUP": {"8": cfg,
    "16": cfg}}`` for ``verify_cost.py --mma-configs``. A bucket timed at several row counts
    takes its largest one. Returns the picks."""
    cases = [c for path in paths for c in json.load(open(path))]
    picks, report = {}, []
    for shape, gs in sorted({(c["shape"], c["group_size"]) for c in cases}):
        for m in sorted({c["m"] for c in cases if c["shape"] == shape}):
            at = [c for c in cases if c["shape"] == shape and c["m"] == m]
            default = next((c for c in at if c["path"] == "default"), None)
            configs = [c for c in at if c["path"] == "config" and c.get("us")]
            if default is None or not configs:
                continue
            best = min(configs, key=lambda c: c["us"])
            gain = 1 - best["us"] / default["us"]
            report.append(f"{shape} M={m}: default {default['us']:.2f} us, best {best['config']} "
                          f"{best['us']:.2f} us ({gain:+.1%})")
            if gain > margin and m > 1:
                picks.setdefault(f"{shape}:{gs}", {})["8" if m <= 8 else "16"] = list(best["config"])
    print("\n".join(report) + f"\npicked (margin {margin:.0%}): {json.dumps(picks)}")
    with open(out_path, "w") as fh:
        json.dump(picks, fh, indent=1)
    return picks


def _choices(*allowed):
    """argparse type: comma-separated integers, each one of ``allowed``."""
    def parse_list(text):
        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
        bad = [v for v in values if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad} not in {list(allowed)}")
        return values
    return parse_list


def _configs_arg(text):
    """argparse type: ``WK,NT,U,KC,XL,LB[,MR,FU,LP,XS]`` items separated by ';'."""
    out = []
    fields = ",".join(CONFIG_FIELDS)
    for item in filter(None, text.split(";")):
        try:
            cfg = tuple(int(v) for v in item.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: expected integers {fields}") from None
        if not 6 <= len(cfg) <= len(CONFIG_FIELDS):
            raise argparse.ArgumentTypeError(f"{item!r}: expected 6 to {len(CONFIG_FIELDS)} integers {fields}")
        cfg += CONFIG_TAIL[len(cfg) - 6:]
        wk, nt, u, kc, xl, lb, mr, fu, lp, xs = cfg
        if wk not in (-1, 1, 2, 4, 8, 16) or nt not in (1, 2, 4) or u not in (1, 2, 4) or not {kc, xl} <= {0, 1} \
                or lb not in (0, 1, 2, 3, 4) or not {mr, fu} <= {-1, 0, 1} or lp not in (0, 64, 128, 256) or xs not in (0, 1):
            raise argparse.ArgumentTypeError(f"{item!r}: out of range")
        out.append(cfg)
    return tuple(out)


def _shapes(text):
    """argparse type: ``NxK:GROUP`` items, comma-separated (e.g. ``28672x4096:64``)."""
    out = []
    for item in text.split(","):
        try:
            nk, gs = item.split(":")
            n, k = (int(v) for v in nk.lower().split("x"))
            out.append((n, k, int(gs)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: expected NxK:GROUP, e.g. 4096x4096:64") from None
        if n <= 0 or k <= 0 or n % 16 or k % int(gs) or int(gs) not in (32, 64, 128):
            raise argparse.ArgumentTypeError(f"{item!r}: N must be a positive multiple of 16, K of the group (32/64/128)")
    return tuple(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--floor", action="store_true", help="sum arrays of each shape's bytes (run under ncu)")
    ap.add_argument("--regs", action="store_true",
                    help="compile the swept cases with the local nvcc (sm_90) and print registers and spills")
    ap.add_argument("--configs", type=_configs_arg, default=(),
                    help="explicit cases WK,NT,U,KC,XL,LB[,MR,FU,LP,XS] separated by ';' (WK -1: the default plan's), "
                         "instead of the --wk/--nt/--u product")
    ap.add_argument("--parse", default=None)
    ap.add_argument("--pick", default=None,
                    help="comma-separated --parse outputs: write the configurations that beat the default "
                         "by more than --margin to --out (for verify_cost.py --mma-configs)")
    ap.add_argument("--margin", type=float, default=0.03)
    ap.add_argument("--order", default=None)
    ap.add_argument("--out", default="mma_sweep.json")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--wk", type=_choices(1, 2, 4, 8, 16), default=(1, 2, 4, 8, 16),
                    help="--ncu: warps splitting K to sweep (comma-separated, from 1,2,4,8,16)")
    ap.add_argument("--nt", type=_choices(1, 2, 4), default=(1, 2, 4),
                    help="--ncu: 16-row tiles per warp to sweep (from 1,2,4)")
    ap.add_argument("--u", type=_choices(1, 2, 4), default=(1, 2, 4), help="--ncu: chunks in flight to sweep (from 1,2,4)")
    ap.add_argument("--launches", type=int, default=2,
                    help="--ncu: launches per case (>= 2; the first warms up, the median of the rest counts)")
    ap.add_argument("--rows", type=_choices(*range(1, 17)), default=(1,),
                    help="--ncu: row counts timed for every case (1..16)")
    ap.add_argument("--shapes", type=_shapes, default=SHAPES,
                    help="weight shapes NxK:GROUP, comma-separated (default: the four of SHAPES)")
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    if sum((args.floor, args.ncu, args.regs, args.parse is not None, args.pick is not None)) > 1:
        ap.error("--floor, --ncu, --regs, --parse and --pick are separate runs: give one")
    if args.pick:
        return pick(args.pick.split(","), args.margin, args.out)
    if args.floor:
        return floor_run(dtype, args.shapes)
    if args.ncu:
        return ncu_run(dtype, args.wk, args.nt, args.u, args.rows, args.shapes, args.configs, max(2, args.launches))
    if args.regs:
        return regs_run(dtype, args.wk, args.nt, args.u, args.rows, args.shapes, args.configs)
    if args.parse:
        return parse(args.parse, args.order, args.out)
    rows = []
    for n, k, gs in args.shapes:
        count = max(2, min(64, -(-256_000_000 // (n * k // 2))))
        sets = _weight_sets(n, k, 4, gs, dtype, count)
        nbytes = _nbytes(*sets[0])
        mlx = {m: time_us(sets, m, k, gs, dtype, "off", args.reps) for m in (1, 8, 16)}
        default = {m: (plan(m, n, k, 4, gs, dtype).consts, time_us(sets, m, k, gs, dtype, "auto", args.reps))
                   for m in (1, 8, 16)}
        print(f"{n}x{k} g{gs}: mlx {mlx}  default {[(dict(c), round(t, 2)) for c, t in default.values()]}",
              flush=True)
        cases = []
        for wk, nt, u in _configs(n, k, gs, dtype):
            res = {}
            for m, mb in ((1, 8), (8, 8), (16, 16)):
                if not qmv.mma_config_fits(nt, u, mb, wk):
                    continue
                qmv.set_mma_config(n, k, 4, wk=wk, nt_u={mb: (nt, u)})
                got = dict(plan(m, n, k, 4, gs, dtype).consts)
                if (got["WK"], got["NT"], got["U"]) != (wk, nt, u):
                    continue
                res[m] = time_us(sets, m, k, gs, dtype, "auto", args.reps)
            qmv.clear_mma_config()
            if res:
                cases.append({"wk": wk, "nt": nt, "u": u, "t_us": res})
                print(f"  wk {wk:2d} nt {nt} u {u}: " + "  ".join(f"M={m} {t:7.2f} us" for m, t in res.items()),
                      flush=True)
        best1 = min((c for c in cases if 1 in c["t_us"]), key=lambda c: c["t_us"][1])
        rows.append({"shape": f"{n}x{k}", "group_size": gs, "weight_bytes": nbytes, "matmuls_per_graph": count,
                     "reps": args.reps, "mlx_us": mlx,
                     "default": {m: {"consts": dict(c), "t_us": t} for m, (c, t) in default.items()},
                     "cases": cases, "best_m1": best1,
                     "bw_tbs_m1": {"mlx": nbytes / mlx[1] / 1e6, "default": nbytes / default[1][1] / 1e6,
                                   "best": nbytes / best1["t_us"][1] / 1e6}})
        print(f"  -> M=1 TB/s: mlx {rows[-1]['bw_tbs_m1']['mlx']:.2f} default "
              f"{rows[-1]['bw_tbs_m1']['default']:.2f} best {rows[-1]['bw_tbs_m1']['best']:.2f} "
              f"({best1['wk']}, {best1['nt']}, {best1['u']})", flush=True)
        json.dump(rows, open(args.out, "w"), indent=1)
        del sets
        mx.clear_cache()


if __name__ == "__main__":
    main()
