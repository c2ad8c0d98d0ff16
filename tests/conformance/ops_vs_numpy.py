#!/usr/bin/env python3
"""Op conformance: every op on every dtype it admits, run through `tessel run`
on a real local cluster (2 workers x 2 devices), checked against numpy.

Each case writes a graph (protobuf text), its inputs (.npy), runs the CLI on a
device chosen round-robin, and compares the fetched outputs with numpy's.
bf16 has no numpy dtype: it travels as uint16 bit patterns and is computed in
float32 then rounded to nearest even, as the CPU backend does.
"""
import argparse, os, signal, subprocess, sys, tempfile
import numpy as np

FLOATS = ["f32", "f64", "f16", "bf16"]
INTS = ["s32", "s64", "u8"]
ALL = FLOATS + INTS + ["pred"]
NP = {"f32": np.float32, "f64": np.float64, "f16": np.float16, "bf16": np.float32,
      "s32": np.int32, "s64": np.int64, "u8": np.uint8, "pred": np.bool_}
PROTO = {d: d.upper() for d in ALL}


def to_bf16_bits(x):
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.astype(np.uint16)


def from_bf16_bits(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def store(dt, x):  # value -> what goes in the .npy
    if dt == "bf16":
        return to_bf16_bits(x)
    return np.asarray(x).astype(NP[dt])


def load(dt, x):  # .npy contents -> comparable values
    return from_bf16_bits(x) if dt == "bf16" else x


def rnd(rng, dt, shape, lo=-3, hi=3, positive=False):
    if dt == "pred":
        return rng.integers(0, 2, shape).astype(np.bool_)
    if dt in INTS:
        lo2 = 1 if positive else (0 if dt == "u8" else lo * 10)
        return rng.integers(lo2, hi * 10, shape).astype(NP[dt])
    x = rng.uniform(0.1 if positive else lo, hi, shape)
    if dt == "bf16":
        return from_bf16_bits(to_bf16_bits(x))
    return x.astype(NP[dt])


def rounded(dt, x):  # numpy result rounded to dt's precision
    if dt == "bf16":
        return from_bf16_bits(to_bf16_bits(np.asarray(x, np.float32)))
    return np.asarray(x).astype(NP[dt])


def type_text(dt, shape):
    return "type { dtype: %s %s}" % (PROTO[dt], "".join("dims: %d " % d for d in shape))


class Case:
    def __init__(self, name, dtype):
        self.name, self.dtype = name, dtype
        self.nodes, self.inputs, self.expected = [], {}, {}

    def param(self, dt, x):
        i = len(self.inputs)
        name = "p%d" % i
        self.nodes.append('nodes { name: "%s" op: PARAMETER parameter { index: %d } %s }'
                          % (name, i, type_text(dt, x.shape)))
        self.inputs[name] = (dt, x)
        return name

    def node(self, text):
        self.nodes.append("nodes { %s }" % text)

    def output(self, name, dt, expected, tol=0.0):
        self.expected[name] = (dt, np.asarray(expected), tol)

    def graph(self):
        return 'name: "%s"\n%s\n%s\n' % (self.name, "\n".join(self.nodes),
                                         "\n".join('outputs: "%s"' % o for o in self.expected))


def tol_for(dt, loose=1.0):
    return {"f32": 2e-6, "f64": 1e-12, "f16": 2e-3, "bf16": 1.6e-2}.get(dt, 0.0) * loose


UNARY = {  # op: (numpy fn, dtypes, positive inputs)
    "NEG": (np.negative, FLOATS + INTS, False), "ABS": (np.abs, FLOATS + ["s32", "s64"], False),
    "EXP": (np.exp, FLOATS, False), "LOG": (np.log, FLOATS, True), "LOG1P": (np.log1p, FLOATS, True),
    "TANH": (np.tanh, FLOATS, False), "LOGISTIC": (lambda x: 1 / (1 + np.exp(-x)), FLOATS, False),
    "SQRT": (np.sqrt, FLOATS, True), "RSQRT": (lambda x: 1 / np.sqrt(x), FLOATS, True),
    "FLOOR": (np.floor, FLOATS, False), "CEIL": (np.ceil, FLOATS, False),
    "ROUND": (lambda x: np.sign(x) * np.floor(np.abs(x) + 0.5), FLOATS, False),
    "SIGN": (np.sign, FLOATS + ["s32", "s64"], False),
    "NOT": (lambda x: np.logical_not(x) if x.dtype == np.bool_ else np.invert(x), INTS + ["pred"], False),
}


def int_div(a, b):
    q = np.abs(a.astype(np.int64)) // np.abs(b.astype(np.int64))
    return (np.sign(a.astype(np.int64)) * np.sign(b.astype(np.int64)) * q)


BINARY = {
    "ADD": (np.add, FLOATS + INTS), "SUB": (np.subtract, FLOATS + INTS), "MUL": (np.multiply, FLOATS + INTS),
    "DIV": (lambda a, b: np.divide(a, b) if a.dtype.kind == "f" else int_div(a, b), FLOATS + INTS),
    "REM": (lambda a, b: np.fmod(a, b), FLOATS + INTS),
    "POW": (np.power, FLOATS + INTS), "MAX": (np.maximum, FLOATS + INTS), "MIN": (np.minimum, FLOATS + INTS),
    "AND": (lambda a, b: a & b, INTS + ["pred"]), "OR": (lambda a, b: a | b, INTS + ["pred"]),
    "XOR": (lambda a, b: a ^ b, INTS + ["pred"]),
}
COMPARE = {"EQ": np.equal, "NE": np.not_equal, "LT": np.less, "LE": np.less_equal,
           "GT": np.greater, "GE": np.greater_equal}


def wrap(dt, x):
    return np.asarray(x).astype(np.int64).astype(NP[dt]) if dt in INTS else x


def cases(rng):
    shape = (3, 5)
    for dt in ALL:
        c = Case("unary_" + dt, dt)
        for op, (fn, dts, pos) in UNARY.items():
            if dt not in dts:
                continue
            x = rnd(rng, dt, shape, positive=pos)
            if op == "ROUND" and dt in FLOATS:
                x = rounded(dt, np.where(rng.integers(0, 2, shape) == 1, np.floor(x) + 0.5, x))
            p = c.param(dt, x)
            c.node('name: "%s" op: %s operands: "%s"' % (op.lower(), op, p))
            xc = x.astype(np.float32) if dt in ("f16", "bf16") else x
            c.output(op.lower(), dt, rounded(dt, wrap(dt, fn(xc))), tol_for(dt, 4))
        if c.expected:
            yield c
        c = Case("binary_" + dt, dt)
        for op, (fn, dts) in BINARY.items():
            if dt not in dts:
                continue
            pos = op in ("DIV", "REM", "POW")
            a = rnd(rng, dt, shape, positive=op == "POW" and dt in FLOATS)
            b = rnd(rng, dt, shape, positive=pos)
            if op == "POW" and dt in INTS:
                a, b = (rng.integers(0, 5, shape).astype(NP[dt]), rng.integers(0, 4, shape).astype(NP[dt]))
            if op in ("DIV", "REM") and dt in ("s32", "s64"):
                b = np.where(rng.integers(0, 2, shape) == 1, b, -b).astype(NP[dt])
            pa, pb = c.param(dt, a), c.param(dt, b)
            c.node('name: "%s" op: %s operands: ["%s", "%s"]' % (op.lower(), op, pa, pb))
            ac, bc = (a.astype(np.float32), b.astype(np.float32)) if dt in ("f16", "bf16") else (a, b)
            c.output(op.lower(), dt, rounded(dt, wrap(dt, fn(ac, bc))), tol_for(dt, 4))
        if c.expected:
            yield c
        c = Case("compare_select_" + dt, dt)
        a = rnd(rng, dt, shape)
        b = np.where(rng.integers(0, 3, shape) == 0, a, rnd(rng, dt, shape)).astype(a.dtype)
        pa, pb = c.param(dt, a), c.param(dt, b)
        for d, fn in COMPARE.items():
            c.node('name: "%s" op: COMPARE operands: ["%s", "%s"] compare { direction: %s }' % (d.lower(), pa, pb, d))
            c.output(d.lower(), "pred", fn(a, b))
        pp = c.param("pred", rng.integers(0, 2, shape).astype(np.bool_))
        c.node('name: "sel" op: SELECT operands: ["%s", "%s", "%s"]' % (pp, pa, pb))
        c.output("sel", dt, np.where(c.inputs[pp][1], a, b))
        if dt != "pred":
            lo, hi = np.minimum(a, b), np.maximum(a, b)
            pl, px, ph = c.param(dt, lo), c.param(dt, rnd(rng, dt, shape)), c.param(dt, hi)
            c.node('name: "clamp" op: CLAMP operands: ["%s", "%s", "%s"]' % (pl, px, ph))
            c.output("clamp", dt, np.minimum(np.maximum(c.inputs[px][1], lo), hi))
        yield c
        c = Case("convert_from_" + dt, dt)
        x = rnd(rng, dt, shape, lo=0 if dt == "u8" else -3, hi=3)
        if dt in FLOATS:
            x = rounded(dt, np.abs(x) * 40)  # in range of every integer type
        p = c.param(dt, x)
        for to in ALL:
            c.node('name: "to_%s" op: CONVERT operands: "%s" convert { dtype: %s }' % (to, p, PROTO[to]))
            xv = x.astype(np.float64) if dt != "pred" else x
            if to == "pred":
                want = xv != 0
            elif to in INTS and dt in FLOATS:
                want = np.trunc(xv).astype(np.int64).astype(NP[to])
            elif to in INTS:
                want = np.asarray(xv).astype(np.int64).astype(NP[to])
            else:
                want = rounded(to, xv.astype(np.float64))
            c.output("to_" + to, to, want, tol_for(to))
        yield c
        # Layout ops.
        c = Case("layout_" + dt, dt)
        x = rnd(rng, dt, (2, 3, 4))
        p = c.param(dt, x)
        c.node('name: "tr" op: TRANSPOSE operands: "%s" transpose { permutation: [2, 0, 1] }' % p)
        c.output("tr", dt, np.transpose(x, (2, 0, 1)))
        c.node('name: "rs" op: RESHAPE operands: "%s" reshape { dims: [4, 6] }' % p)
        c.output("rs", dt, x.reshape(4, 6))
        c.node('name: "sl" op: SLICE operands: "%s" slice { start: [0, 1, 0] limit: [2, 3, 4] strides: [1, 1, 3] }' % p)
        c.output("sl", dt, x[0:2, 1:3, 0:4:3])
        y = rnd(rng, dt, (2, 1, 4))
        z = rnd(rng, dt, (2, 2, 4))
        py, pz = c.param(dt, y), c.param(dt, z)
        c.node('name: "cat" op: CONCATENATE operands: ["%s", "%s", "%s"] concatenate { dimension: 1 }' % (p, py, pz))
        c.output("cat", dt, np.concatenate([x, y, z], axis=1))
        c.node('name: "bc" op: BROADCAST_IN_DIM operands: "%s" broadcast_in_dim { dims: [2, 5, 3, 4] broadcast_dimensions: [0, 2, 3] }' % p)
        c.output("bc", dt, np.broadcast_to(x[:, None], (2, 5, 3, 4)))
        m = rnd(rng, dt, (3, 4))
        pm = c.param(dt, m)
        pv = c.param(dt, rnd(rng, dt, ()))
        c.node('name: "pad" op: PAD operands: ["%s", "%s"] pad { low: [1, -1] high: [0, 2] interior: [1, 0] }' % (pm, pv))
        want = np.full((6, 5), c.inputs[pv][1], dtype=m.dtype)
        for i in range(3):
            for j in range(1, 4):
                want[1 + 2 * i, j - 1] = m[i, j]
        c.output("pad", dt, want)
        yield c
        if dt == "pred":
            continue
        # Reductions, arg reductions, dots.
        c = Case("reduce_dot_" + dt, dt)
        x = rnd(rng, dt, (3, 4, 5), lo=-2, hi=2)
        if dt in INTS:
            x = rng.integers(0 if dt == "u8" else -3, 4, (3, 4, 5)).astype(NP[dt])
        p = c.param(dt, x)
        xc = x.astype(np.float64)
        for kind, fn in (("SUM", np.sum), ("PROD", np.prod), ("REDUCE_MAX", np.max), ("REDUCE_MIN", np.min)):
            for dims in ((0,), (2,), (0, 2), (0, 1, 2)):
                name = "%s_%s" % (kind.lower(), "".join(map(str, dims)))
                c.node('name: "%s" op: REDUCE operands: "%s" reduce { kind: %s %s}' % (
                    name, p, kind, "".join("dims: %d " % d for d in dims)))
                r = fn(xc, axis=dims)
                c.output(name, dt, rounded(dt, wrap(dt, r)), tol_for(dt, 20))
        for op, fn in (("ARGMAX", np.argmax), ("ARGMIN", np.argmin)):
            for idt in ("S32", "S64"):
                name = "%s_%s" % (op.lower(), idt.lower())
                c.node('name: "%s" op: %s operands: "%s" arg_reduce { dimension: 1 index_dtype: %s }' % (name, op, p, idt))
                c.output(name, idt.lower(), fn(x.astype(np.float64), axis=1))
        a = rnd(rng, dt, (4, 3), lo=-2, hi=2)
        b = rnd(rng, dt, (4, 5), lo=-2, hi=2)
        if dt in INTS:
            a, b = rng.integers(0, 5, (4, 3)).astype(NP[dt]), rng.integers(0, 5, (4, 5)).astype(NP[dt])
        pa, pb = c.param(dt, a), c.param(dt, b)
        c.node('name: "dot_t" op: DOT_GENERAL operands: ["%s", "%s"] dot_general { lhs_contracting: 0 rhs_contracting: 0 }' % (pa, pb))
        c.output("dot_t", dt, rounded(dt, wrap(dt, a.astype(np.float64).T @ b.astype(np.float64))), tol_for(dt, 20))
        ba, bb = rnd(rng, dt, (2, 3, 4), lo=-1, hi=1), rnd(rng, dt, (2, 4, 5), lo=-1, hi=1)
        if dt in INTS:
            ba, bb = rng.integers(0, 5, (2, 3, 4)).astype(NP[dt]), rng.integers(0, 5, (2, 4, 5)).astype(NP[dt])
        pba, pbb = c.param(dt, ba), c.param(dt, bb)
        c.node('name: "bmm" op: DOT_GENERAL operands: ["%s", "%s"] dot_general { lhs_batch: 0 rhs_batch: 0 lhs_contracting: 2 rhs_contracting: 1 }' % (pba, pbb))
        c.output("bmm", dt, rounded(dt, wrap(dt, ba.astype(np.float64) @ bb.astype(np.float64))), tol_for(dt, 20))
        yield c
        c = Case("constants_" + dt, dt)
        c.node('name: "fill" op: CONSTANT constant { fill { f: 2 } } %s' % type_text(dt, (2, 3)))
        c.output("fill", dt, np.full((2, 3), 2).astype(NP[dt]) if dt != "bf16" else np.full((2, 3), 2.0, np.float32))
        c.node('name: "iota" op: CONSTANT constant { iota { dimension: 1 } } %s' % type_text(dt, (2, 4)))
        c.output("iota", dt, np.broadcast_to(np.arange(4), (2, 4)).astype(NP[dt]))
        vals = [1, 0, 3, 2, 5, 4]
        c.node('name: "lit" op: CONSTANT constant { literal { %s } } %s' % (
            "".join(("f: %d " if dt in FLOATS else "i: %d ") % v for v in vals), type_text(dt, (3, 2))))
        c.output("lit", dt, np.array(vals).reshape(3, 2).astype(NP[dt]))
        yield c
    # A fused chain: max(tanh(a*b + c), 0) * 2 over many blocks.
    c = Case("fused_chain", "f32")
    n = 10007
    a, b, d = (rnd(rng, "f32", (n,)) for _ in range(3))
    pa, pb, pd = c.param("f32", a), c.param("f32", b), c.param("f32", d)
    c.node('name: "m" op: MUL operands: ["%s", "%s"]' % (pa, pb))
    c.node('name: "s" op: ADD operands: ["m", "%s"]' % pd)
    c.node('name: "t" op: TANH operands: "s"')
    c.node('name: "zero" op: CONSTANT constant { fill { f: 0 } } %s' % type_text("f32", (n,)))
    c.node('name: "r" op: MAX operands: ["t", "zero"]')
    c.node('name: "two" op: CONSTANT constant { fill { f: 2 } } %s' % type_text("f32", ()))
    c.node('name: "twos" op: BROADCAST_IN_DIM operands: "two" broadcast_in_dim { dims: %d }' % n)
    c.node('name: "y" op: MUL operands: ["r", "twos"]')
    c.output("y", "f32", np.maximum(np.tanh(a * b + d), 0) * 2, 1e-6)
    yield c


NEGATIVE = [
    ("arity", 'nodes { name: "p0" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 2 } }\n'
              'nodes { name: "bad" op: ADD operands: "p0" }\noutputs: "bad"', "bad", "expected 2 operands"),
    ("dtype", 'nodes { name: "p0" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 2 } }\n'
              'nodes { name: "p1" op: PARAMETER parameter { index: 1 } type { dtype: S32 dims: 2 } }\n'
              'nodes { name: "bad" op: ADD operands: ["p0", "p1"] }\noutputs: "bad"', "bad", "expected f32[2], got s32[2]"),
    ("dangling", 'nodes { name: "p0" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 2 } }\n'
                 'nodes { name: "bad" op: NEG operands: "ghost" }\noutputs: "bad"', "bad", "'ghost'"),
    ("cycle", 'nodes { name: "a" op: NEG operands: "bad" }\nnodes { name: "bad" op: NEG operands: "a" }\n'
              'outputs: "bad"', "'a'", "not defined before"),
    ("negative_dim", 'nodes { name: "bad" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: -2 } }\n'
                     'outputs: "bad"', "bad", "negative"),
    ("reshape", 'nodes { name: "p0" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 6 } }\n'
                'nodes { name: "bad" op: RESHAPE operands: "p0" reshape { dims: [4, 2] } }\noutputs: "bad"',
     "bad", "element counts differ"),
    ("unknown_op", 'nodes { name: "p0" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 2 } }\n'
                   'nodes { name: "bad" op: 7 operands: "p0" }\noutputs: "bad"', "bad", "unknown op"),
]


def run_case(tessel, env, tmp, case, device):
    d = os.path.join(tmp, case.name)
    os.makedirs(d, exist_ok=True)
    g = os.path.join(d, "graph.textproto")
    with open(g, "w") as f:
        f.write(case.graph())
    args = [tessel, "run", g, "--device", str(device)]
    for name, (dt, x) in case.inputs.items():
        path = os.path.join(d, name + ".npy")
        np.save(path, store(dt, x))
        args += ["--input", "%s=%s" % (name, path)]
    for name in case.expected:
        args += ["--fetch", "%s=%s" % (name, os.path.join(d, "out_" + name + ".npy"))]
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        return ["%s: tessel run failed: %s" % (case.name, r.stderr.strip())]
    failures = []
    for name, (dt, want, tol) in case.expected.items():
        got = load(dt, np.load(os.path.join(d, "out_" + name + ".npy")))
        want = np.asarray(want)
        if got.shape != want.shape:
            failures.append("%s/%s: shape %s, expected %s" % (case.name, name, got.shape, want.shape))
            continue
        if dt in FLOATS:
            g64, w64 = got.astype(np.float64), want.astype(np.float64)
            ok = np.allclose(g64, w64, rtol=tol, atol=tol, equal_nan=True)
        else:
            ok = np.array_equal(got.astype(np.int64), want.astype(np.int64))
        if not ok:
            bad = np.argwhere(~np.isclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol))[:3]
            failures.append("%s/%s (%s): first mismatches at %s: got %s, expected %s" % (
                case.name, name, dt, bad.tolist(), [got[tuple(i)] for i in bad], [want[tuple(i)] for i in bad]))
    return failures


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--filter", default="")
    args = ap.parse_args()
    tessel = os.path.join(args.bin, "tessel")
    local = subprocess.Popen([tessel, "local", "--workers", "2", "--devices-per-worker", "2"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        addr = local.stdout.readline().strip()
        if not addr:
            print("could not start a local cluster")
            return 1
        env = dict(os.environ, TESSEL_COORDINATOR=addr)
        rng = np.random.default_rng(1234)
        failures, n = [], 0
        with tempfile.TemporaryDirectory() as tmp:
            for case in cases(rng):
                if args.filter not in case.name:
                    continue
                failures += run_case(tessel, env, tmp, case, n % 4)
                n += 1
            for name, text, node, needle in NEGATIVE:
                g = os.path.join(tmp, "neg_%s.textproto" % name)
                with open(g, "w") as f:
                    f.write(text + "\n")
                r = subprocess.run([tessel, "compile", g], env=env, capture_output=True, text=True, timeout=60)
                n += 1
                if r.returncode == 0 or node not in r.stderr or needle not in r.stderr or "INVALID_ARGUMENT" not in r.stderr:
                    failures.append("negative case %s: expected INVALID_ARGUMENT naming %s and '%s', got rc %d: %s"
                                    % (name, node, needle, r.returncode, r.stderr.strip()))
            # The daemons keep serving after bad input.
            again = Case("after_errors", "f32")
            x = rnd(rng, "f32", (4,))
            p = again.param("f32", x)
            again.node('name: "y" op: NEG operands: "%s"' % p)
            again.output("y", "f32", -x)
            failures += run_case(tessel, env, tmp, again, 3)
            n += 1
        for f in failures:
            print("FAIL", f)
        print("%d cases, %d failed" % (n, len(failures)))
        return 1 if failures else 0
    finally:
        local.send_signal(signal.SIGTERM)
        local.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
