#!/usr/bin/python3
"""Independent reference of kmoe's Engram hashing (docs/spec/MODEL.md section 4, steps 1-6).

Written from the spec text only (no kmoe C++ consulted). Plain Python integers; uint64
arithmetic is emulated with explicit masks.

Run `/usr/bin/python3 tests/reference/engram_hash_reference.py` to print the golden values
(C++-ready initializer lists) that tests pin; `--out FILE` also writes them to FILE.
"""

import sys

MASK64 = (1 << 64) - 1


def splitmix64(state):
    """One splitmix64 draw as spelled in MODEL.md section 4 step 3. Returns (new_state, r)."""
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    r = z ^ (z >> 31)
    return state, r


def multiplier_bound(vocab_c):
    """M = floor((2^63 - 1) / V')."""
    return ((1 << 63) - 1) // vocab_c


def multipliers(seed, layer, max_ngram, vocab_c):
    """m_0..m_{N-1} for the Engram layer with 0-based block index `layer`."""
    state = (seed + 10007 * layer) & MASK64
    M = multiplier_bound(vocab_c)
    half = max(1, M // 2)
    out = []
    for _ in range(max_ngram):
        state, r = splitmix64(state)
        out.append(2 * (r % half) + 1)
    return out


def is_prime(n):
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    d = 3
    while d * d <= n:
        if n % d == 0:
            return False
        d += 2
    return True


def moduli(layers, max_ngram, heads, table_size):
    """Primes of every Engram layer, drawn from one model-wide set of used primes.

    layers: Engram block indices (any order; walked in increasing order).
    table_size: dict or sequence indexable by order n (2..N), or a single int for all orders.
    Returns {layer: (primes, offsets, R)} with primes/offsets listed over heads
    j = (n-2)*K + h (order 2 heads first).
    """
    used = set()
    result = {}
    for l in sorted(layers):
        primes = []
        for n in range(2, max_ngram + 1):
            ts = table_size if isinstance(table_size, int) else table_size[n]
            cur = ts - 1
            for _h in range(heads):
                cur += 1
                while not is_prime(cur) or cur in used:
                    cur += 1
                used.add(cur)
                primes.append(cur)
        offsets = []
        acc = 0
        for p in primes:
            offsets.append(acc)
            acc += p
        result[l] = (primes, offsets, acc)
    return result


def rows(tokens, layer, *, seed, max_ngram, heads, vocab_c, pad_id, layer_moduli,
         compress=None):
    """Row indices and mix values for one sequence at one Engram layer.

    tokens: token ids x[0..T-1]; compress: optional list mapping id -> canonical id
    (identity when None). layer_moduli: (primes, offsets, R) of this layer from moduli().
    Returns (row, mix): row[t][j] = o_j + (s_n[t] mod p_j) with j = (n-2)*K + h;
    mix[n][t] = s_n[t] for n = 2..N.
    """
    c = (lambda v: v) if compress is None else (lambda v: compress[v])
    xc = [c(v) for v in tokens]
    padc = c(pad_id)
    T = len(xc)
    N = max_ngram
    m = multipliers(seed, layer, N, vocab_c)
    primes, offsets, _R = layer_moduli
    S = [[xc[t - k] if t >= k else padc for t in range(T)] for k in range(N)]
    mix = {}
    for n in range(2, N + 1):
        s = []
        for t in range(T):
            acc = 0
            for k in range(n):
                prod = S[k][t] * m[k]
                assert prod < (1 << 63), "spec: products fit in 63 bits"
                acc ^= prod
            s.append(acc)
        mix[n] = s
    row = []
    for t in range(T):
        r_t = []
        for n in range(2, N + 1):
            for h in range(heads):
                j = (n - 2) * heads + h
                r_t.append(offsets[j] + mix[n][t] % primes[j])
        row.append(r_t)
    return row, mix


# ----------------------------------------------------------------------------------------
# Golden configuration
GOLDEN = dict(vocab_c=320, max_ngram=3, heads=4, table_size=1600, seed=0, layers=[1, 3],
              pad_id=0, text="Hello, world")


def golden_text():
    g = GOLDEN
    V, N, K, seed = g["vocab_c"], g["max_ngram"], g["heads"], g["seed"]
    tokens = list(g["text"].encode("ascii"))
    mods = moduli(g["layers"], N, K, {n: g["table_size"] for n in range(2, N + 1)})
    M = multiplier_bound(V)

    # Sanity checks.
    all_primes = []
    for l in g["layers"]:
        ms = multipliers(seed, l, N, V)
        for mk in ms:
            assert mk % 2 == 1 and 0 < mk < M, (l, mk)
        primes, offsets, R = mods[l]
        assert len(primes) == (N - 1) * K
        for p in primes:
            assert is_prime(p) and p >= g["table_size"], p
        for n in range(2, N + 1):
            ps = primes[(n - 2) * K:(n - 1) * K]
            assert all(a < b for a, b in zip(ps, ps[1:])), ps
        assert R == sum(primes)
        all_primes += primes
    assert len(set(all_primes)) == len(all_primes) == len(g["layers"]) * (N - 1) * K

    lines = []
    out = lines.append
    out("// Engram hashing golden values (tests/reference/engram_hash_reference.py)")
    out("// config: V'=%d (identity compression), N=%d, K=%d, table_size=%d per order, "
        "seed=%d, engram layers=%s, pad_id=%d" % (V, N, K, g["table_size"], seed,
                                                 g["layers"], g["pad_id"]))
    out("// tokens = bytes of %r: {%s}" % (g["text"], ", ".join(map(str, tokens))))
    out("// M = floor((2^63-1)/V') = %du" % M)
    for l in g["layers"]:
        ms = multipliers(seed, l, N, V)
        out("// layer %d multipliers m_0..m_%d" % (l, N - 1))
        out("const uint64_t kMult_L%d[%d] = {%s};" % (l, N, ", ".join("%dull" % v for v in ms)))
    for l in g["layers"]:
        primes, offsets, R = mods[l]
        out("// layer %d primes p_j, j=(n-2)*K+h (order 2 heads then order 3 heads); R = sum p_j"
            % l)
        out("const int64_t kPrimes_L%d[%d] = {%s};" % (l, len(primes), ", ".join(map(str, primes))))
        out("const int64_t kOffsets_L%d[%d] = {%s};" % (l, len(offsets),
                                                      ", ".join(map(str, offsets))))
        out("const int64_t kRows_L%d = %d;" % (l, R))

    l = g["layers"][0]
    row, mix = rows(tokens, l, seed=seed, max_ngram=N, heads=K, vocab_c=V, pad_id=g["pad_id"],
                    layer_moduli=mods[l])
    primes, offsets, R = mods[l]
    for t in range(len(tokens)):
        for j in range(len(primes)):
            assert offsets[j] <= row[t][j] < offsets[j] + primes[j]
            assert 0 <= row[t][j] < R
    out("// layer %d row indices [t][j], t = 0..%d, j = 0..%d (t-major)"
        % (l, len(tokens) - 1, len(primes) - 1))
    out("const int64_t kRowIdx_L%d[%d][%d] = {" % (l, len(tokens), len(primes)))
    for t in range(len(tokens)):
        out("    {%s}," % ", ".join(map(str, row[t])))
    out("};")
    for n in range(2, N + 1):
        out("// layer %d order-%d mix s_%d[t], t = 0..%d" % (l, n, n, len(tokens) - 1))
        out("const uint64_t kMix%d_L%d[%d] = {%s};"
            % (n, l, len(tokens), ", ".join("%dull" % v for v in mix[n])))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    text = golden_text()
    sys.stdout.write(text)
    if len(sys.argv) == 3 and sys.argv[1] == "--out":
        with open(sys.argv[2], "w") as f:
            f.write(text)
