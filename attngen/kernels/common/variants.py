"""The attention variant as hooks both passes call (FlashInfer's attention/variants.py in spirit).

One `Variant` per plan (`Variant.of(plan)`, plan being the forward's Plan; the backward passes
`bp.forward`) answers, as expression text, what the variant adds to the FlashAttention skeleton:
    the score chain   score / transform (forward), log2_score and its derivative dz_ds (backward)
    the element mask  mask_bind / mask_cond (forward [rows, keys]), bwd_mask_bind / bwd_mask_cond
                      (the backward's transposed [keys, rows] tile, or its dq kernel's [rows, keys])
    row statistics    scaled, scale_setup, max_floor, sink_init, lse, normalize (forward);
                      bwd_scale_setup (backward: LSE2 and dPsum are laid out by its template)
    constants         the module-level lines the variant adds (constants)
The derivative sits next to the expression it differentiates. A new variant, say a learnable
per-head temperature Temp[h], would extend `score` (s / Temp[head]), `dz_ds` (its factor 1 / Temp[head]),
`constants` or the plan's extra tensors for Temp, and, if the backward returns dTemp, a row statistic
hook such as the sinks' (sink_init's counterpart in the backward template).
The layout (rows, heads, lengths) is not the variant's: hooks that need a layout fact take it as
an argument. attngen/tiles.py remains the tile-range algebra; this module only prints elements.
"""

from __future__ import annotations

import math

from attngen import expr
from attngen.hw import FP8_MAX_OFFSET, fp8_transpose_keys
from attngen.spec import out_dtype_of
from attngen.kernels.common.layouts import layout_of


# -- where an element sits: the forward's tile positions (visit `tile`, row q0 + row0 + i, key j) ---------
# Kernels of specs without a window keep the expressions that predate windows, byte for byte;
# `windowed(plan)` switches to the general form (first tile, both edges, visit indices).
def windowed(plan) -> bool:
    return plan.spec.window != (-1, -1)


def has_first_tile(plan) -> bool:
    """The block's first visited K tile is not 0 (the window has a left edge, or the block takes a split)."""
    return plan.window_left is not None or layout_of(plan).split_kv


def has_offset(plan) -> bool:
    """The variant reads causal_offset (kv_len - q_len): a causal mask, a window or ALiBi's distance.
    A variant fact (which masks and biases the spec has); where the offset is bound is the layout's."""
    return plan.spec.causal or windowed(plan) or plan.spec.alibi


def row_pos(plan, row: str = "q0 + row0 + i") -> str:
    """The query position of a block's packed row: the row itself, or row // GQA_GROUP when the
    query heads of one KV head are packed into the tile's rows."""
    return layout_of(plan).query_row(row)


def row_head(plan) -> str:
    """The query head of row i: the block's head, or (packed GQA) the row's place in the group."""
    return layout_of(plan).query_head()


def key_tile(plan, tile: str) -> str:
    """The K tile index of visit `tile` (the loop variable, or "0" for the prologue)."""
    if plan.block_mask:
        return "kv_tile"  # bound by the block mask's walk (block_mask.visit_lines)
    if not has_first_tile(plan):
        return tile
    return "first_tile" if tile == "0" else f"(first_tile + {tile})"


def key_index(plan, tile: str) -> str:
    """The key column `j` of visit `tile` as a kernel expression."""
    t = key_tile(plan, tile)
    return "j" if t == "0" else f"{t} * BLOCK_N + j"


# The backward's two orientations: (query row text, key text, the row's index name, the key's index name).
MAIN = ("m0 + j", "key0 + i", "j", "i")  # the main kernel's transposed tile [keys, rows]: (i, j) = key key0 + i, row m0 + j
DQ = ("q0 + row0 + i", "kv_tile * DQ_BLOCK_N + j", "i", "j")  # the dq kernel's [rows, keys], as the forward's


def _and(parts: list[str], also: tuple = ()) -> str:
    """Conjunction of `parts`, a part that is itself a conjunction (or one of `also`) parenthesised."""
    return " and ".join(f"({p})" if " and " in p or any(a in p for a in also) else p for p in parts)


class Variant:
    """The variant of one plan: each method returns kernel text (see the module docstring)."""

    def __init__(self, plan):
        self.plan = plan
        self.spec = plan.spec

    @classmethod
    def of(cls, plan) -> Variant:
        return cls(plan)

    @property
    def prescaled(self) -> bool:
        """The scores are turned into base-2 units in place (softcap, ALiBi or a score_mod)."""
        return self.plan.prescaled

    @property
    def fp8(self) -> bool:
        return getattr(self.plan, "fp8", False)  # the backward's plans have no fp8 (refused)

    @property
    def qk_scale(self) -> str:
        """The name of what q . k is multiplied by: the call's softmax_scale, which fp8 folds the q and k descales into."""
        return "qk_scale" if self.fp8 else "softmax_scale"

    @property
    def has_edges(self) -> bool:
        """A causal mask or a window: each element is tested against the diagonal."""
        return self.plan.window_left is not None or self.plan.window_right is not None

    # -- the score chain and its derivative --------------------------------------------------------
    def mod_at(self, e, row: str, key: str, head: str, score: str | None) -> str:
        """A parsed score_mod/mask_mod (or a derivative) as TileLang at query `row`, key `key`, head `head`."""
        tensors = {t.name: t for t in self.plan.extra}
        names = {"b": "batch_idx", "h": head, "q_idx": f"({row})", "kv_idx": f"({key})"}
        if score is not None:
            names["score"] = f"({score})"
        return expr.emit(e, names, lambda n: tensors[n].param, lambda n, axis: tensors[n].dim(axis))

    def score(self, acc: str, row: str, key: str, head: str, mods: bool = True) -> str:
        """The natural-units score of the raw q . k in `acc` at query `row`, key `key`, head `head`:
        softcap, then ALiBi, then (with `mods`) the score_mod."""
        spec = self.spec
        s = f"{acc} * {self.qk_scale}"
        if spec.softcap:
            s = f"SOFTCAP * T.tanh({acc} * softcap_scale)"  # softcap_scale = softmax_scale / SOFTCAP, once per warpgroup
        if spec.alibi:
            s = f'{s} - Alibi[{head}] * T.Cast("float32", T.abs({row} + causal_offset - ({key})))'
        if mods and self.plan.score_expr is not None:
            s = self.mod_at(self.plan.score_expr, row, key, head, s)
        return s

    def transform(self, tile: str) -> str:
        """The forward: acc_s[i, j] (q . k) -> the final score in base-2 units: softcap, ALiBi,
        score_mod, then * log2(e). The mods are defined on the natural-units score q . k *
        softmax_scale (FlexAttention's `score`); the result is multiplied by log2(e) once, so the
        softmax needs no scale_log2."""
        p = self.plan
        return f"({self.score('acc_s[i, j]', row_pos(p), key_index(p, tile), row_head(p))}) * LOG2E"

    def log2_score(self, dq: bool = False) -> str:
        """The backward: acc_s[i, j] (the raw q . k) -> the forward's final score in base 2 (what LSE2 is in)."""
        if not self.prescaled:
            return "acc_s[i, j] * scale_log2"
        row, key = (DQ if dq else MAIN)[:2]
        return f"({self.score('acc_s[i, j]', row, key, 'head')}) * LOG2E"

    def dz_ds(self, dq: bool = False) -> str:
        """d(final score)/d(q . k * scale) at element (i, j) from the raw acc_s, or "" where it is 1:
        softcap's 1 - tanh^2 times the score_mod's derivative (expr.derivative) at the softcapped score."""
        row, key = (DQ if dq else MAIN)[:2]
        factors = []
        if self.spec.softcap:
            t = "T.tanh(acc_s[i, j] * softcap_scale)"
            factors.append(f"(1.0 - {t} * {t})")
        if self.plan.score_expr is not None:
            d = expr.derivative(self.plan.score_expr)
            if d.canonical.strip() != "1":
                u = self.score("acc_s[i, j]", row, key, "head", mods=False)
                factors.append(f"({self.mod_at(d, row, key, 'head', u)})")
        return " * ".join(factors)

    def tensor_grads(self, learnable: tuple, at: tuple | None = None) -> list[tuple[str, str]]:
        """The main kernel's scatter of the learnable tensors' gradients (docs/backward.md, "Learnable
        tensors"): (target element, d(final score)/d(that entry) from the raw acc_s, "" where 1) per read site;
        dT[target] += dZ * value, dZ = P (dP - dPsum) the gradient of the score_mod's output. The
        target is the read's own element (its index clamped as the read's), in dT = "d" + the param,
        at the main kernel's (batch, head, row, key), or `at`'s names (the deterministic walk's)."""
        row, key = MAIN[:2]
        b, h, q, kv = at or ("batch_idx", "head", f"({row})", f"({key})")
        e = self.plan.score_expr
        u = self.score("acc_s[i, j]", row, key, "head", mods=False)  # the score_mod's input
        tensors = {t.name: t for t in self.plan.extra}
        grads = []
        for name in learnable:
            if name == "alibi_slopes":  # score -= slope[h] |row + offset - key|: d/d slope = -|...| times the mod's d/d score
                value = f'(-T.Cast("float32", T.abs({row} + causal_offset - ({key}))))'
                if e is not None and expr.derivative(e).canonical.strip() != "1":
                    value = f"{value} * ({self.mod_at(expr.derivative(e), row, key, 'head', u)})"
                grads.append((f"d{tensors[name].param}[{h}]", value))
                continue
            for site in expr.tensor_reads(e, name):
                target = expr.emit(e, {"b": b, "h": h, "q_idx": q, "kv_idx": kv},
                                   lambda n: "d" + tensors[n].param if n == name else tensors[n].param,
                                   lambda n, axis: tensors[n].dim(axis), node=site)
                d = expr.derivative(e, site)
                grads.append((target, "" if d.canonical.strip() == "1" else f"({self.mod_at(d, row, key, 'head', u)})"))
        return grads

    # -- the element mask: the forward's [rows, keys] tile ----------------------------------------------
    def causal_diag(self, tile: str) -> tuple[str, str] | None:
        """The diagonal in visit `tile`: (name, value), row i's diagonal key being j = i + name.

        The row-independent part is bound once per tile (a Let) so that the per-element tests of
        the causal mask and the window's edges are `i + diag >= j`, `j >= i + diag - left`: lowering
        then simplifies two indices per element, not the whole sum (docs/build.md, "Emitted-source
        edits"). A mask_mod kernel binds it for its causal or window part; the mod itself is an
        arbitrary expression of q_idx and kv_idx with no such part. None without a causal mask or a
        window, and for packed GQA, whose row position (q0 + row0 + i) // GQA_GROUP does not split
        off a row-independent part.
        """
        if layout_of(self.plan).pack_gqa or not self.has_edges:
            return None
        t = key_tile(self.plan, tile)
        value = "q0 + row0 + causal_offset" if t == "0" else f"q0 + row0 + causal_offset - {t} * BLOCK_N"
        return ("diag0" if tile == "0" else "diag"), value

    def mask_bind(self, tile: str) -> str:
        """The statement the mask of visit `tile` needs before its loop, or ""."""
        diag = self.causal_diag(tile)
        if diag is None:
            return ""
        name, value = diag
        t = key_tile(self.plan, tile)
        if not windowed(self.plan) and self.plan.mask_expr is None:  # the plain causal mask
            return f"{name} = {value}  # row i of tile {t} sees keys j <= i + {name}"
        return f"{name} = {value}  # row i's diagonal in tile {t} is key j = i + {name}"

    def mask_cond(self, tile: str) -> str:
        """Is key `tile * BLOCK_N + j` visible to query row `q0 + row0 + i`?"""
        p = self.plan
        key = key_index(p, tile)
        row = row_pos(p)
        diag = self.causal_diag(tile)
        if not windowed(p) and p.mask_expr is None:
            if self.spec.causal:
                # bottom-right alignment already keeps every real row below kv_len: row i < q_len sees
                # keys up to i + kv_len - q_len < kv_len; rows past q_len are never stored
                return f"i + {diag[0]} >= j" if diag else f"{row} + causal_offset >= {key}"
            return f"{key} < kv_len"  # the partial last tile (not aligned)
        # row + causal_offset vs key, or with the diagonal bound (all but packed GQA): i + diag vs j
        near, far = (f"i + {diag[0]}", "j") if diag else (f"{row} + causal_offset", key)
        parts = self._edges(near, far, bound=diag is not None)
        if p.window_right != 0:  # right == 0 keeps every real row's keys below kv_len (see above)
            parts.append(f"{key} < kv_len")
        if p.mask_expr is not None:
            parts.append(self.mod_at(p.mask_expr, row, key, row_head(p), None))
        return " and ".join(parts) if len(parts) == 1 else _and(parts)

    def _edges(self, near: str, far: str, bound: bool = True) -> list[str]:
        """The window's two edges (a causal mask: the right one at 0) between the diagonal `near`
        and the key `far` (tiles.visible's edges). `bound`: `near` is the bound diagonal, so a left
        edge at 0 prints as `far >= near`."""
        left, right = self.plan.window_left, self.plan.window_right
        parts = []
        if left is not None:
            parts.append(f"{far} >= {near} - {left}" if left or not bound else f"{far} >= {near}")
        if right is not None:
            parts.append(f"{near} + {right} >= {far}" if right else f"{near} >= {far}")
        return parts

    # -- the element mask: the backward's tiles (MAIN: transposed [keys, rows]; DQ: [rows, keys]) -------
    def bwd_mask_bind(self, dq: bool = False) -> str:
        if not self.has_edges:
            return ""
        if dq:
            return "diag = q0 + row0 + causal_offset - kv_tile * DQ_BLOCK_N  # row i's diagonal key is j = i + diag"
        return "diag = m0 + causal_offset - key0  # row m0 + j's diagonal key is key0 + j + diag"

    def bwd_mask_cond(self, dq: bool = False, inline: bool = False) -> str:
        """Does the query row see the key (the edges of tiles.visible, with the diagonal bound per
        tile), and, in the main kernel, is the row a real one (< q_len: its rows past q_len are loaded
        as zeros, but a score_mod could make P infinite there)? `inline`: the main kernel's diagonal
        written out, not read from bwd_mask_bind's `diag` (a test of every visit, before any bind)."""
        p = self.plan
        row, key, ri, ki = DQ if dq else MAIN
        diag = "(m0 + causal_offset - key0)" if inline and not dq else "diag"
        parts = self._edges(f"{ri} + {diag}", ki)
        if p.window_right != 0:  # right == 0 keeps a real row's keys below kv_len
            parts.append(f"{key} < kv_len")
        if not dq:
            parts.append(f"{row} < q_len")
        if p.mask_expr is not None:
            parts.append(self.mod_at(p.mask_expr, row, key, "head", None))
        return _and(parts, also=(" or ",))

    # -- the row statistics ----------------------------------------------------------------------------------
    def scaled(self, x: str) -> str:
        """A raw score or row max in the softmax's base-2 units."""
        return x if self.prescaled else f"{x} * scale_log2"

    def scale_setup(self) -> list[str]:
        """The forward consumer's lines that derive, once, what its scores are multiplied by from the
        run-time softmax_scale (a float32 parameter: one compiled kernel serves every scale); fp8's
        descales (FA3's: float32 [batch, kv_heads]) first, q's and k's into that scale, v's kept for normalize."""
        lines = self._descale_setup()
        if not self.prescaled:
            return lines + [f"scale_log2 = {self.qk_scale} * LOG2E  # the softmax runs in base 2: "
                            "exp2(s * scale_log2) = exp(s * softmax_scale)"]
        return lines + self._softcap_scale()

    def _descale_setup(self) -> list[str]:
        if not self.fp8:
            return []
        return ["kv_head = head // GQA_GROUP  # a query head takes its KV head's descales",
                "qk_scale = softmax_scale * Q_descale[batch_idx, kv_head] * K_descale[batch_idx, kv_head]"
                "  # q, k descales fold into the scale",
                "v_descale = V_descale[batch_idx, kv_head]  # applied with the row sum's division"]

    def exp_offset(self) -> str:
        """fp8 (FA3's Max_offset): P = exp2(s - m + MAX_OFFSET) spans e4m3's range, not [0, 1] where it has 3 bits;
        the row sum carries the same 2**MAX_OFFSET, so O = PV / sum is unchanged (lse takes it out)."""
        return " + MAX_OFFSET" if self.fp8 else ""

    def sink_term(self) -> str:
        """A sink's own term in the row sum at m = sink: exp2(0) = 1, or with fp8's offset 2**MAX_OFFSET."""
        return "T.exp2(MAX_OFFSET)" if self.fp8 else "1.0"

    def bwd_scale_setup(self) -> list[str]:
        """The backward's counterpart: P is recomputed against the forward's LSE2."""
        if not self.prescaled:
            return ["scale_log2 = softmax_scale * LOG2E  # P = exp2(k . q * scale_log2 - LSE2)"]
        return self._softcap_scale()

    def _softcap_scale(self) -> list[str]:
        if self.spec.softcap:
            return [f"softcap_scale = {self.qk_scale} / SOFTCAP  # tanh's argument: the scaled score / SOFTCAP"]
        return []

    def max_floor(self) -> str:
        """The running max's start in a kernel without sinks: finite, and finite once scaled.

        Not -inf: a row whose scores so far are all -inf (masked, or an inf in q or k) then keeps a
        finite max and gets exp2(-inf - floor) = 0 where -inf - -inf is NaN, and no tile needs a guard.
        m_cur holds q . k units, scaled by the run-time scale_log2 in the exponent, which exceeds 1
        for softmax_scale > ln 2; the lowest float times that is -inf again. So the floor is the lowest
        float halved (rounding cannot carry the product past the overflow) and divided by scale_log2
        where that is above 1: computed once per consumer, it scales to at least -FLT_MAX / 2 for every
        valid scale. Prescaled scores are base-2 units already (no scale follows): the lowest float."""
        if self.prescaled:
            return "T.min_value(ACCUM)"
        return "T.min_value(ACCUM) * 0.5 / T.max(scale_log2, 1.0)"

    def sink_init(self) -> str:
        """The running max starts at the sink's logit (in the units m_cur holds), the row sum at its exp(0) = 1."""
        if not self.spec.sinks:
            return ""
        if self.prescaled:
            return "Sinks[head] * LOG2E"
        return f"Sinks[head] / {self.qk_scale}"  # a natural-log logit in the units of q . k

    def normalize(self) -> str:
        """The epilogue's division by the row sum. A row whose every score is -inf (masked, or from an
        inf in q or k, in any kernel) ends with sum 0 and acc_o 0: it gives 0, as in the reference.
        The running max never reaches -inf (it starts at a finite floor, max_floor; docs/online-softmax.md
        step 4), so this once-per-row test is the only guard: no tile pays for one."""
        if self.fp8:
            if not self.spec.sinks:
                return ("acc_o[i, j] = T.if_then_else(row_sum[i] == 0, 0, acc_o[i, j] * (v_descale / row_sum[i]))"
                        "  # a row that sees no key gives 0")
            return "acc_o[i, j] *= v_descale / row_sum[i]"
        if not self.spec.sinks:  # with a sink every row sum is >= exp(0)
            return "acc_o[i, j] = T.if_then_else(row_sum[i] == 0, 0, acc_o[i, j] / row_sum[i])  # a row that sees no key gives 0"
        return "acc_o[i, j] /= row_sum[i]"

    def writes_lse(self) -> bool:
        return bool(self.spec.lse or layout_of(self.plan).split_kv)  # a split always writes its LSE: the combine weighs by it

    def lse(self) -> str:
        """Natural-log log-sum-exp of a row: (m * scale_log2 + log2(row sum)) * ln 2; -inf for a row with no key."""
        if not self.writes_lse():
            return ""
        offset = " - MAX_OFFSET" if self.fp8 else ""  # fp8's row sum carries 2**MAX_OFFSET
        value = f"({self.scaled('m_cur[i]')} + T.log2(row_sum[i]){offset}) * LN2"
        if self.plan.guard_empty_rows and not self.spec.sinks:
            return f"T.if_then_else(row_sum[i] == 0, -T.infinity(ACCUM), {value})"
        return value

    # -- constants -------------------------------------------------------------------------------------------
    def constants(self, lse: bool = True) -> list[str]:
        """The module-level constants the variant adds (the backward takes no LN2: `lse` False)."""
        lines = []
        if self.plan.head_dim_v != self.spec.head_dim:
            lines.append(f"HEAD_DIM_V = {self.plan.head_dim_v}  # V and O head dim")
        if self.spec.softcap:
            lines.append(f"SOFTCAP = {self.spec.softcap!r}  # score = SOFTCAP * tanh(score / SOFTCAP)")
        if lse and self.writes_lse():
            lines.append(f"LN2 = {math.log(2)!r}  # the LSE is returned in natural log")
        if self.fp8:
            lines.append(f'OUT_DTYPE = "{out_dtype_of(self.spec)}"  # O: an fp8 kernel writes 16 bits')
            keys = fp8_transpose_keys(self.plan.head_dim_v, self.plan.producer_regs)
            if self.spec.v_layout != "transposed":  # a transposed V (v_layout) lands as V^T: nothing to transpose
                lines.append(f"TRANSPOSE_KEYS = {keys}  # keys of V the producer transposes at a time (its registers: docs/fp8.md)")
            lines.append(f"MAX_OFFSET = {float(FP8_MAX_OFFSET)!r}  # P = exp2(s - m + MAX_OFFSET): e4m3's range, "
                         "not [0, 1] (FA3's Max_offset)")
        return lines
