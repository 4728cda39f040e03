"""The `ai.fastcar` custom ops, defined as ONNX functions.

Each op ships inside fast.onnx as a model-local function, so a stock ONNX Runtime runs the model
with no extra library (ORT inlines functions at session creation), while a registered native
kernel with the same (domain, op) takes precedence and later backends see the ops as units.
Bodies use only ops whose signature is stable from opset 13 up (no ReduceMean/ReduceMax with
axes inputs), so one text serves models exported at opset 17 to 24. Semantics: docs/DESIGN.md.
"""

from __future__ import annotations

import onnx
import onnx.parser
import onnx_ir as ir

from fastcar_compile.core import contract

DOMAIN = contract.DOMAIN
VERSION = contract.OPSET_VERSION

_MLP_CACHE_READ = """
<domain: "ai.fastcar", opset_import: ["" : {opset}]>
MLPCacheRead (past_mlp_cache, slot) => (cached) {{
  cached = Gather <axis = 1> (past_mlp_cache, slot)
}}
"""

_MLP_CACHE_UPDATE = """
<domain: "ai.fastcar", opset_import: ["" : {opset}]>
MLPCacheUpdate <age_offset: int = 0> (past_mlp_cache, past_mlp_age, branch, replay, slot, write)
    => (present_mlp_cache, present_mlp_age) {{
  zero = Constant <value = int64[1] {{0}}> ()
  one_s = Constant <value = int64 {{1}}> ()
  zero_s = Constant <value = int64 {{0}}> ()
  shape_1w1 = Constant <value = int64[3] {{1, -1, 1}}> ()
  shape_1w = Constant <value = int64[2] {{1, -1}}> ()
  nz = NonZero (write)
  widx = Squeeze (nz, zero)
  slots_w = Gather (slot, widx)
  vals_w = Gather <axis = 1> (branch, widx)
  vshape = Shape (vals_w)
  slots_1w1 = Reshape (slots_w, shape_1w1)
  cache_idx = Expand (slots_1w1, vshape)
  present_mlp_cache = ScatterElements <axis = 1> (past_mlp_cache, cache_idx, vals_w)
  age_w = Gather <axis = 1> (past_mlp_age, slots_w)
  rep_w = Gather <axis = 1> (replay, widx)
  aged = Add (age_w, one_s)
  zeros_w = Mul (age_w, zero_s)
  age_offset = Constant <value_int: int = @age_offset> ()
  reset_w = Add (zeros_w, age_offset)
  new_age = Where (rep_w, aged, reset_w)
  ashape = Shape (new_age)
  slots_1w = Reshape (slots_w, shape_1w)
  age_idx = Expand (slots_1w, ashape)
  present_mlp_age = ScatterElements <axis = 1> (past_mlp_age, age_idx, new_age)
}}
"""

# CompressedAttention's body: dense causal GQA attention (all compression modes off), what the native kernel
# computes in plain mode. The KV buffer is either the growing cache (past has P = total_len - S rows: present =
# Concat(past, new)) or a preallocated one (N >= total_len rows: rows P..total_len-1 replaced); the one Concat of
# past[:P], new, past[total_len:] covers both. A query at KV index P + i sees key j iff j <= P + i and
# attention_mask[b, j] != 0; one that sees none (a left pad) averages every value of its row, which is what the
# exporters' finite-minimum masks make softmax do. The compressed modes (budget > 0) need the kernel.
# q/k/v are [B, heads, S, D] (qkv_perm [0, 1, 2, 3], the default) or, with qkv_perm [0, 2, 1, 3], [B, S, heads * D] /
# [B, S, heads, D] as the projections produce them (no layout ops between the MatMuls and the op): the body views
# them as [B, *, *, D] and applies the permutation.
_COMPRESSED_ATTENTION = """
<domain: "ai.fastcar", opset_import: ["" : {opset}]>
CompressedAttention <num_heads, kv_num_heads, scale, budget, sinks, window, frame_tokens, tempcache_sim, eviction,
                     lsh_bits, lsh_tables, lsh_planes, int8_dirs, int8_tables, int8_planes, prune_prompt,
                     qkv_perm: ints = [0, 1, 2, 3], do_rotary: int = 0, rotary_interleaved: int = 0>
    (q_in, k_in, v_in, past_key, past_value, attention_mask, total_len, past_slots, k_raw, past_key_raw)
    => (out, present_key, present_value) {{
  zero_ = Constant <value = int64[1] {{0}}> ()
  minus1_ = Constant <value = int64[1] {{-1}}> ()
  D_ = Shape <start = 3, end = 4> (past_key)
  heads_shape = Concat <axis = 0> (zero_, zero_, minus1_, D_)
  q_heads = Reshape (q_in, heads_shape)
  q = Transpose <perm: ints = @qkv_perm> (q_heads)
  k_heads = Reshape (k_in, heads_shape)
  k = Transpose <perm: ints = @qkv_perm> (k_heads)
  v_heads = Reshape (v_in, heads_shape)
  v = Transpose <perm: ints = @qkv_perm> (v_heads)
  zero = Constant <value = int64[1] {{0}}> ()
  one = Constant <value = int64[1] {{1}}> ()
  two = Constant <value = int64[1] {{2}}> ()
  minus1 = Constant <value = int64[1] {{-1}}> ()
  axes_last = Constant <value = int64[1] {{-1}}> ()
  big = Constant <value = int64[1] {{9223372036854775807}}> ()
  zero_s = Constant <value = int64 {{0}}> ()
  one_s = Constant <value = int64 {{1}}> ()
  shape_00m1 = Constant <value = int64[3] {{0, 0, -1}}> ()
  lowest = Constant <value = float {{-3.4e38}}> ()
  sc = Constant <value_float: float = @scale> ()
  S = Shape <start = 2, end = 3> (q)
  T = Cast <to = 7> (total_len)
  T1 = Reshape (T, one)
  P = Sub (T1, S)
  k_head = Slice (past_key, zero, P, two)
  k_tail = Slice (past_key, T1, big, two)
  present_key = Concat <axis = 2> (k_head, k, k_tail)
  v_head = Slice (past_value, zero, P, two)
  v_tail = Slice (past_value, T1, big, two)
  present_value = Concat <axis = 2> (v_head, v, v_tail)
  keys = Slice (present_key, zero, T1, two)
  vals = Slice (present_value, zero, T1, two)
  B = Shape <start = 0, end = 1> (q)
  Hq = Shape <start = 1, end = 2> (q)
  Hkv = Shape <start = 1, end = 2> (past_key)
  D = Shape <start = 3, end = 4> (q)
  q5_shape = Concat <axis = 0> (B, Hkv, minus1, S, D)
  q5 = Reshape (q, q5_shape)
  k5 = Unsqueeze (keys, two)
  kt = Transpose <perm = [0, 1, 2, 4, 3]> (k5)
  raw = MatMul (q5, kt)
  scores = Mul (raw, sc)
  S_s = Squeeze (S, zero)
  T_s = Squeeze (T1, zero)
  P_s = Squeeze (P, zero)
  i = Range (zero_s, S_s, one_s)
  pi = Add (i, P_s)
  j = Range (zero_s, T_s, one_s)
  j_row = Unsqueeze (j, zero)
  pi_col = Unsqueeze (pi, one)
  causal = LessOrEqual (j_row, pi_col)
  real = Cast <to = 9> (attention_mask)
  m_shape = Concat <axis = 0> (B, one, one, one, T1)
  real5 = Reshape (real, m_shape)
  vis = And (causal, real5)
  masked = Where (vis, scores, lowest)
  probs = Softmax <axis = -1> (masked)
  v5 = Unsqueeze (vals, two)
  ctx5 = MatMul (probs, v5)
  ctx_shape = Concat <axis = 0> (B, Hq, S, D)
  ctx4 = Reshape (ctx5, ctx_shape)
  ctx_bshd = Transpose <perm = [0, 2, 1, 3]> (ctx4)
  out = Reshape (ctx_bshd, shape_00m1)
}}
"""

# CompressedAttention on a packed QKV [B, S, (H + 2 Hkv) D] (key/value empty) that rotates q and k itself
# (do_rotary: com.microsoft.RotaryEmbedding arithmetic, half-split or interleaved, with cos_cache/sin_cache
# [max_pos, rotary_dim / 2] at KV index total_len - S + i, which is where GroupQueryAttention rotates with
# seqlens_k = total_len - 1). The function overload PACKED_ROTARY of the op, so the node keeps its type (the
# native kernel, discovery and the FPGA partitioner see one CompressedAttention) while its body, written only for
# this form, never names an input another form leaves out (ONNX Runtime refuses a body node whose required input
# is absent even in an If branch not taken). passes/fused_attention.py emits it (attention_form.Packing).
PACKED_ROTARY = "packed_rotary"
_COMPRESSED_ATTENTION_PACKED_ROTARY = f"""
<domain: "ai.fastcar", opset_import: ["" : {{opset}}, "ai.fastcar" : 1, "{contract.MS_DOMAIN}" : 1]>
CompressedAttention <num_heads, kv_num_heads, scale, qkv_perm: ints = [0, 2, 1, 3], do_rotary: int = 1,
                     rotary_interleaved: int = 0>
    (qkv, k_in, v_in, past_key, past_value, attention_mask, total_len, past_slots, k_raw, past_key_raw, past_dense,
     video_start, cos_cache, sin_cache) => (out, present_key, present_value) {{{{
  zero = Constant <value = int64[1] {{{{0}}}}> ()
  last = Constant <value = int64[1] {{{{-1}}}}> ()
  H_s = Constant <value_int: int = @num_heads> ()
  Hkv_s = Constant <value_int: int = @kv_num_heads> ()
  H = Unsqueeze (H_s, zero)
  Hkv = Unsqueeze (Hkv_s, zero)
  D = Shape <start = 3, end = 4> (past_key)
  HD = Mul (H, D)
  KD = Mul (Hkv, D)
  HKD = Add (HD, KD)
  HKKD = Add (HKD, KD)
  q_raw = Slice (qkv, zero, HD, last)
  k_raw_p = Slice (qkv, HD, HKD, last)
  v = Slice (qkv, HKD, HKKD, last)
  total64 = Cast <to = 7> (total_len)
  total1 = Reshape (total64, last)
  S = Shape <start = 1, end = 2> (qkv)
  start = Sub (total1, S)
  q = {contract.MS_DOMAIN}.RotaryEmbedding <interleaved: int = @rotary_interleaved, num_heads: int = @num_heads>
      (q_raw, start, cos_cache, sin_cache)
  k = {contract.MS_DOMAIN}.RotaryEmbedding <interleaved: int = @rotary_interleaved, num_heads: int = @kv_num_heads>
      (k_raw_p, start, cos_cache, sin_cache)
  out, present_key, present_value = ai.fastcar.CompressedAttention <num_heads: int = @num_heads,
      kv_num_heads: int = @kv_num_heads, scale: float = @scale, qkv_perm = [0, 2, 1, 3]>
      (q, k, v, past_key, past_value, attention_mask, total_len)
}}}}
"""

# TemporalGate: one op, one body per form (contract.GateForm), each composed from the pieces below in this order:
# the query in [B, H, S, D] (`qb`; packed: the first num_heads * head_dim channels, rotated for do_rotary), tau,
# the token positions (key length or total_len), the aligned key rows (K[max(p - L, 0)], or `key` row i for
# aligned_keys), then the shared TAS and decision; packed forms add the slots' cached rows and the If conditions,
# select_rows the computing rows of mlp_input. docs/DESIGN.md states the semantics.
_GATE_CONSTS = """
  zero = Constant <value = int64[1] {0}> ()
  one = Constant <value = int64[1] {1}> ()
  two = Constant <value = int64[1] {2}> ()
  minus1 = Constant <value = int64[1] {-1}> ()
  zero_s = Constant <value = int64 {0}> ()
  one_s = Constant <value = int64 {1}> ()
  L = Constant <value_int: int = @frame_tokens> ()
  K = Constant <value_int: int = @max_replay> ()
"""
_GATE_QUERY_BHSD = """
  qb = Identity (q)
"""
_GATE_QUERY_PACKED = """
  nh_s = Constant <value_int: int = @num_heads> ()
  nh = Unsqueeze (nh_s, zero)
  Dk = Shape <start = 3, end = 4> (key)
  HD = Mul (nh, Dk)
  q_flat = Slice (q, zero, HD, minus1)
"""
_GATE_QUERY_UNROTATED = """
  q_sel = Identity (q_flat)
"""
_GATE_QUERY_ROTATED = f"""
  total64_r = Cast <to = 7> (total_len)
  total_r = Reshape (total64_r, minus1)
  Sq = Shape <start = 1, end = 2> (q)
  start = Sub (total_r, Sq)
  q_sel = {contract.MS_DOMAIN}.RotaryEmbedding <interleaved: int = @interleaved, num_heads: int = @num_heads,
      rotary_embedding_dim: int = @rotary_embedding_dim> (q_flat, start, cos_cache, sin_cache)
"""
_GATE_QUERY_HEADS = """
  q4_shape = Concat <axis = 0> (zero, zero, nh, Dk)
  q4 = Reshape (q_sel, q4_shape)
  qb = Transpose <perm = [0, 2, 1, 3]> (q4)
"""
_GATE_TAU = """
  taus = Reshape (threshold, minus1)
  t_index = Constant <value_int: int = @threshold_index> ()
  tau_t = Gather (taus, t_index)
  tau = Cast <to = 1> (tau_t)
"""
_GATE_T_FROM_KEY = """
  T = Shape <start = 2, end = 3> (key)
"""
_GATE_T_FROM_TOTAL_LEN = """
  total64 = Cast <to = 7> (total_len)
  T = Reshape (total64, one)
"""
_GATE_POSITIONS = """
  S = Shape <start = 2, end = 3> (qb)
  S_s = Squeeze (S, zero)
  T_s = Squeeze (T, zero)
  P_s = Sub (T_s, S_s)
  p = Range (P_s, T_s, one_s)
  aligned = Sub (p, L)
"""
_GATE_ROWS_FROM_POSITIONS = """
  idx = Max (aligned, zero_s)
"""
_GATE_ROWS_GIVEN = """
  idx = Range (zero_s, S_s, one_s)
"""
_GATE_DECISION = """
  k_al = Gather <axis = 2> (key, idx)
  qf = Cast <to = 1> (qb)
  kf = Cast <to = 1> (k_al)
  B = Shape <start = 0, end = 1> (qb)
  Hkv = Shape <start = 1, end = 2> (key)
  SD = Shape <start = 2, end = 4> (qb)
  q5_shape = Concat <axis = 0> (B, Hkv, minus1, SD)
  q5 = Reshape (qf, q5_shape)
  q_grp = ReduceSum <keepdims = 0> (q5, two)
  prod = Mul (q_grp, kf)
  dots = ReduceSum <keepdims = 0> (prod, minus1)
  dsum = ReduceSum <keepdims = 0> (dots, one)
  H = Shape <start = 1, end = 2> (qb)
  D = Shape <start = 3, end = 4> (qb)
  H_s = Squeeze (H, zero)
  D_s = Squeeze (D, zero)
  Hf = Cast <to = 1> (H_s)
  Df = Cast <to = 1> (D_s)
  sqrt_d = Sqrt (Df)
  denom = Mul (Hf, sqrt_d)
  tas = Div (dsum, denom)
  rel = Sub (p, video_start)
  slot = Mod (rel, L)
  first_written = Sub (T_s, L)
  is_video = GreaterOrEqual (p, video_start)
  in_last_frame = GreaterOrEqual (p, first_written)
  write = And (is_video, in_last_frame)
  has_past = Greater (P_s, zero_s)
  fits_frame = LessOrEqual (S_s, L)
  decode = And (has_past, fits_frame)
  after_frame0 = GreaterOrEqual (aligned, video_start)
  pos_ok = And (decode, after_frame0)
  age_stored = Gather <axis = 1> (past_mlp_age, slot)
  age_offset = Constant <value_int: int = @age_offset> ()
  age_slot = Sub (age_stored, age_offset)
  written = GreaterOrEqual (age_slot, zero_s)
  unlimited = Equal (K, zero_s)
  young = Less (age_slot, K)
  guard_ok = Or (unlimited, young)
  slot_ok = And (written, guard_ok)
  elig = And (slot_ok, pos_ok)
  above = Greater (tas, tau)
  replay = And (elig, above)
"""
_GATE_CACHED_AND_CONDITIONS = """
  cached = Gather <axis = 1> (past_mlp_cache, slot)
  replay64 = Cast <to = 7> (replay)
  n_replay = ReduceSum <keepdims = 0> (replay64)
  n_tokens = Size (replay)
  compute_all = Equal (n_replay, zero_s)
  compute_some = Less (n_replay, n_tokens)
"""
_GATE_SELECT_ROWS = f"""
  rows, rows_some = {DOMAIN}.{contract.SELECT_ROWS} (mlp_input, replay)
"""
# attributes the forms share (frame_tokens and max_replay have no default: every gate names them)
_GATE_ATTRIBUTES = ("frame_tokens, max_replay, age_offset: int = 0, num_heads: int = 0, threshold_index: int = 0, "
                    "rotary_embedding_dim: int = 0, interleaved: int = 0, "
                    + ", ".join(f"{a}: int = 0" for a in contract.GATE_FORM_ATTRIBUTES))


def gate_text(form: contract.GateForm, opset: int) -> str:
    """The ONNX text of TemporalGate's body for one form (its overload), composed from the shared pieces."""
    imports = [f'"" : {opset}']
    if form.select_rows:
        imports.append(f'"{DOMAIN}" : {VERSION}')
    if form.do_rotary:
        imports.append(f'"{contract.MS_DOMAIN}" : 1')
    if form.packed_qkv:
        query = [_GATE_QUERY_PACKED, _GATE_QUERY_ROTATED if form.do_rotary else _GATE_QUERY_UNROTATED,
                 _GATE_QUERY_HEADS]
    else:
        query = [_GATE_QUERY_BHSD]
    pieces = [_GATE_CONSTS, *query, _GATE_TAU, _GATE_T_FROM_TOTAL_LEN if form.use_total_len else _GATE_T_FROM_KEY,
              _GATE_POSITIONS, _GATE_ROWS_GIVEN if form.aligned_keys else _GATE_ROWS_FROM_POSITIONS, _GATE_DECISION]
    if form.packed_qkv:
        pieces.append(_GATE_CACHED_AND_CONDITIONS)
    if form.select_rows:
        pieces.append(_GATE_SELECT_ROWS)
    outputs = ", ".join(contract.GATE_OUTPUTS[:form.num_outputs])
    head = (f'<domain: "{DOMAIN}", opset_import: [{", ".join(imports)}]>\n'
            f"{contract.TEMPORAL_GATE} <{_GATE_ATTRIBUTES}>\n"
            f"    ({', '.join(contract.GATE_INPUTS)}) => ({outputs}) {{")
    return head + "".join(pieces) + "}\n"


def gate_function(form: contract.GateForm, opset: int) -> onnx.FunctionProto:
    """TemporalGate's FunctionProto for one form: the overload `form.overload`."""
    proto = onnx.parser.parse_function(gate_text(form, opset))
    proto.overload = form.overload
    return proto


def gate_args(model: ir.Model, form: contract.GateForm, inputs: dict[str, ir.Value | None],
              attributes: dict[str, object]) -> tuple[list[ir.Value | None], dict[str, object]]:
    """A TemporalGate node's positional inputs (given by contract.GATE_INPUTS name) and attributes (the form's
    variant attributes set, 0s left out), its body registered in `model`; the node's overload is form.overload."""
    unknown = set(inputs) - set(contract.GATE_INPUTS)
    if unknown:
        raise ValueError(f"internal: TemporalGate has no input {sorted(unknown)}")
    values = [inputs.get(name) for name in contract.GATE_INPUTS]
    while values[-1] is None:
        values.pop()
    add_gate(model, form, model.opset_imports.get("", 17))
    attrs = {**{k: v for k, v in attributes.items() if k not in contract.GATE_FORM_ATTRIBUTES},
             **{k: v for k, v in form.attributes.items() if v}}
    return values, attrs


def add_gate(model: ir.Model, form: contract.GateForm, opset: int) -> None:
    """Register the body of one TemporalGate form (idempotent); forms other than the plain one are overloads."""
    add_functions(model, opset)
    key = (DOMAIN, contract.TEMPORAL_GATE, form.overload)
    if key not in model.functions:
        model.functions[key] = ir.serde.deserialize_function(gate_function(form, opset))
    if form.overload:
        if form.do_rotary:
            model.opset_imports.setdefault(contract.MS_DOMAIN, 1)
        model.ir_version = max(model.ir_version, OVERLOAD_IR_VERSION)


# ai.fastcar GroupQueryAttention: com.microsoft.GroupQueryAttention's signature (the subset passes/native_gqa.py
# swaps); its body is that op itself, so a model run without the native library (runtime/native/
# group_query_attention.h) behaves exactly as before the swap.
_GROUP_QUERY_ATTENTION = f"""
<domain: "ai.fastcar", opset_import: ["" : {{opset}}, "{contract.MS_DOMAIN}" : 1]>
GroupQueryAttention <num_heads, kv_num_heads, scale, do_rotary: int = 0, rotary_interleaved: int = 0>
    (query, key, value, past_key, past_value, seqlens_k, total_sequence_length, cos_cache, sin_cache, position_ids,
     attention_bias) => (output, present_key, present_value) {{{{
  output, present_key, present_value = {contract.MS_DOMAIN}.GroupQueryAttention <num_heads: int = @num_heads,
      kv_num_heads: int = @kv_num_heads, scale: float = @scale, do_rotary: int = @do_rotary,
      rotary_interleaved: int = @rotary_interleaved> (query, key, value, past_key, past_value, seqlens_k,
      total_sequence_length, cos_cache, sin_cache, position_ids, attention_bias)
}}}}
"""

# The rows of x [..., H] (all axes but the last flattened: B*S tokens) whose token computes (replay false), in
# token order, as [1, n, H], and whether there is any (the compute branch's If condition). BranchPass runs the
# one MLP copy on these rows whether every token computes (n = B*S) or some do.
_SELECT_ROWS = """
<domain: "ai.fastcar", opset_import: ["" : {opset}]>
SelectRows (x, replay) => (rows, compute_some) {{
  zero = Constant <value = int64[1] {{0}}> ()
  minus1 = Constant <value = int64[1] {{-1}}> ()
  zero_s = Constant <value = int64 {{0}}> ()
  keep = Not (replay)
  keep_flat = Reshape (keep, minus1)
  nz = NonZero (keep_flat)
  idx = Squeeze (nz, zero)
  H = Shape <start = -1> (x)
  flat_shape = Concat <axis = 0> (minus1, H)
  x_flat = Reshape (x, flat_shape)
  picked = Gather <axis = 0> (x_flat, idx)
  rows = Unsqueeze (picked, zero)
  n = Size (idx)
  compute_some = Greater (n, zero_s)
}}
"""

# The write-back of SelectRows' rows after the MLP: used [B,S,H] = the computed row for a computing token (rows in
# token order, any leading shape), the slot's cached row for a replaying one; then MLPCacheUpdate of `used`.
_MLP_CACHE_MERGE = """
<domain: "ai.fastcar", opset_import: ["" : {opset}, "ai.fastcar" : 1]>
MLPCacheMerge <age_offset: int = 0> (past_mlp_cache, past_mlp_age, rows, replay, slot, write)
    => (present_mlp_cache, present_mlp_age, used) {{
  minus1 = Constant <value = int64[1] {{-1}}> ()
  cached = Gather <axis = 1> (past_mlp_cache, slot)
  H = Shape <start = 2> (past_mlp_cache)
  flat_shape = Concat <axis = 0> (minus1, H)
  cached_flat = Reshape (cached, flat_shape)
  rows_flat = Reshape (rows, flat_shape)
  keep = Not (replay)
  keep_flat = Reshape (keep, minus1)
  nz = NonZero (keep_flat)
  idx = Transpose (nz)
  merged = ScatterND (cached_flat, idx, rows_flat)
  used_shape = Shape (cached)
  used = Reshape (merged, used_shape)
  present_mlp_cache, present_mlp_age = ai.fastcar.MLPCacheUpdate <age_offset: int = @age_offset>
      (past_mlp_cache, past_mlp_age, used, replay, slot, write)
}}
"""

# The masked-dense bodies' shared parts: the cache's positions (`pos` [S]) with the slicing constants, and the
# joint softmax of the masked cache scores (`masked`) with the chunk's own, its two halves applied to the values
_POSITIONS = """\
  zero1 = Constant <value = int64[1] {0}> ()
  last = Constant <value = int64[1] {-1}> ()
  end = Constant <value = int64[1] {9223372036854775807}> ()
  zero_s = Constant <value = int64 {0}> ()
  one_s = Constant <value = int64 {1}> ()
  minus_inf = Constant <value = float {-inf}> ()
  S_1 = Shape <start = 2, end = 3> (past_key)
  S = Squeeze (S_1)
  pos = Range (zero_s, S, one_s)
"""
_JOINED = """\
  k_t = Transpose <perm = [0, 1, 3, 2]> (k)
  self_scores = MatMul (q, k_t)
  joined = Concat <axis = -1> (masked, self_scores)
  probs = Softmax <axis = -1> (joined)
  p_past = Slice (probs, zero1, S_1, last)
  p_self = Slice (probs, S_1, end, last)
  ctx_past = MatMul (p_past, past_value)
  ctx_self = MatMul (p_self, v)
  out = Add (ctx_past, ctx_self)
"""

# AnnSA over a DiT's frame cache (docs/DESIGN.md): masked dense, for an ONNX Runtime without the native kernel
# (same result; the kernel scores only the selected keys). A bucketed slot is selected where its id equals the
# query's in some table (key_codes -1: not bucketed, never equal: query ids are >= 0); dense slots always.
_ANNSA_ATTENTION = """
<domain: "ai.fastcar", opset_import: ["" : {opset}]>
AnnSAAttention (q, k, v, past_key, past_value, dense, query_codes, key_codes, sorted_codes, sorted_slots)
    => (out) {{
  ax1 = Constant <value = int64[1] {{1}}> ()
  ax2 = Constant <value = int64[1] {{2}}> ()
  ax3 = Constant <value = int64[1] {{3}}> ()
{positions}  dense_col = Unsqueeze (dense, ax1)
  at_dense_b = Equal (dense_col, pos)
  at_dense = Cast <to = 1> (at_dense_b)
  dense_f = ReduceSum <keepdims = 0> (at_dense, zero1)
  qc = Unsqueeze (query_codes, ax3)
  kc = Unsqueeze (key_codes, ax2)
  same_b = Equal (qc, kc)
  same = Cast <to = 1> (same_b)
  shared = ReduceSum <keepdims = 0> (same, last)
  picked = Add (shared, dense_f)
  half = Constant <value = float {{0.5}}> ()
  keep = Greater (picked, half)
  past_key_t = Transpose <perm = [0, 1, 3, 2]> (past_key)
  past_scores = MatMul (q, past_key_t)
  masked = Where (keep, past_scores, minus_inf)
{joined}}}
"""

# Attention over listed cache slots (docs/DESIGN.md): masked dense, for an ONNX Runtime without the native kernel. A
# position is attended where some entry of its (row, head)'s `slots` names it (-1 entries name none); its logit
# takes slot_bias (TempCache's log(count)).
_SLOT_ATTENTION = """
<domain: "ai.fastcar", opset_import: ["" : {opset}]>
SlotAttention (q, k, v, past_key, past_value, slots, slot_bias) => (out) {{
  ax2 = Constant <value = int64[1] {{2}}> ()
  ax3 = Constant <value = int64[1] {{3}}> ()
{positions}  listed = Unsqueeze (slots, ax3)
  at_b = Equal (listed, pos)
  at = Cast <to = 1> (at_b)
  named = ReduceSum <keepdims = 0> (at, ax2)
  half = Constant <value = float {{0.5}}> ()
  keep_hs = Greater (named, half)
  keep = Unsqueeze (keep_hs, ax2)
  bias = Unsqueeze (slot_bias, ax2)
  past_key_t = Transpose <perm = [0, 1, 3, 2]> (past_key)
  raw = MatMul (q, past_key_t)
  biased = Add (raw, bias)
  masked = Where (keep, biased, minus_inf)
{joined}}}
"""


OP_TEXTS = {
    contract.MLP_CACHE_READ: _MLP_CACHE_READ,
    contract.MLP_CACHE_UPDATE: _MLP_CACHE_UPDATE,
    contract.COMPRESSED_ATTENTION: _COMPRESSED_ATTENTION,
    contract.GROUP_QUERY_ATTENTION: _GROUP_QUERY_ATTENTION,
    contract.SELECT_ROWS: _SELECT_ROWS,
    contract.MLP_CACHE_MERGE: _MLP_CACHE_MERGE,
    contract.ANNSA_ATTENTION: _ANNSA_ATTENTION,
    contract.SLOT_ATTENTION: _SLOT_ATTENTION,
}


# (op, overload) -> text of the overloads (IR version >= 10): forms of an op whose body must differ
OVERLOAD_TEXTS = {
    (contract.COMPRESSED_ATTENTION, PACKED_ROTARY): _COMPRESSED_ATTENTION_PACKED_ROTARY,
}
OVERLOAD_IR_VERSION = 10  # NodeProto.overload / FunctionProto.overload


def function_proto(op: str, opset: int, overload: str = "") -> onnx.FunctionProto:
    """The FunctionProto of one ai.fastcar op (or one of its overloads), its body written against the model's
    default opset."""
    if op == contract.TEMPORAL_GATE:
        return gate_function(next(f for f in contract.GATE_FORMS if f.overload == overload), opset)
    text = OVERLOAD_TEXTS[(op, overload)] if overload else OP_TEXTS[op]
    proto = onnx.parser.parse_function(text.format(opset=opset, positions=_POSITIONS, joined=_JOINED))
    proto.overload = overload
    return proto


def add_functions(model: ir.Model, opset: int) -> None:
    """Register every ai.fastcar function in `model` (idempotent; the gate's plain form, gate_args adds the
    others) and import the domain."""
    key = (DOMAIN, contract.TEMPORAL_GATE, "")
    if key not in model.functions:
        model.functions[key] = ir.serde.deserialize_function(gate_function(contract.GateForm(), opset))
    for op in OP_TEXTS:
        key = (DOMAIN, op, "")
        if key not in model.functions:
            model.functions[key] = ir.serde.deserialize_function(function_proto(op, opset))
    model.opset_imports[DOMAIN] = VERSION


def add_overload(model: ir.Model, op: str, overload: str, opset: int) -> None:
    """Register one overload's function (idempotent); the model then needs IR version >= 10."""
    add_functions(model, opset)
    key = (DOMAIN, op, overload)
    if key not in model.functions:
        model.functions[key] = ir.serde.deserialize_function(function_proto(op, opset, overload))
    model.opset_imports.setdefault(contract.MS_DOMAIN, 1)
    model.ir_version = max(model.ir_version, OVERLOAD_IR_VERSION)
