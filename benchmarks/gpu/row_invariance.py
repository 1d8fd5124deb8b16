import json, os, mlx.core as mx
res = {}
for dt in (mx.bfloat16, mx.float32):
    bad = {"rope": 0, "rms": 0, "add_mul": 0}
    mx.random.seed(0)
    x = mx.random.normal((1, 9, 16, 64)).astype(dt)
    for off in list(range(0, 64)) + list(range(1000, 1100)) + [2047, 4095]:
        for L in (2, 3, 5, 8, 9, 10, 16):
            full = mx.fast.rope(x[:, :, :L], 64, traditional=False, base=100000.0, scale=1.0, offset=off)
            rows = mx.concatenate([mx.fast.rope(x[:, :, i:i+1], 64, traditional=False, base=100000.0, scale=1.0, offset=off + i) for i in range(L)], axis=2)
            if not mx.array_equal(full, rows).item():
                bad["rope"] += 1
    h = mx.random.normal((16, 576)).astype(dt); w = mx.random.normal((576,)).astype(dt)
    for L in range(2, 17):
        full = mx.fast.rms_norm(h[:L], w, 1e-5)
        rows = mx.concatenate([mx.fast.rms_norm(h[i:i+1], w, 1e-5) for i in range(L)])
        if not mx.array_equal(full, rows).item():
            bad["rms"] += 1
        a = h[:L] * mx.sigmoid(h[:L]) * h[:L]
        b = mx.concatenate([h[i:i+1] * mx.sigmoid(h[i:i+1]) * h[i:i+1] for i in range(L)])
        if not mx.array_equal(a, b).item():
            bad["add_mul"] += 1
    res[str(dt)] = bad
    print(dt, bad, flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "rowcheck.json"), "w"))
