// Datapath latency model of one matrix core (MAC array, vector unit, SFU, SRAM port) behind the issue interface:
// from the instruction and its row count it takes the cycles of the execution model (simulate.py), written
// here in integer logic from the same definitions (costmodel.py is the other implementation). Not synthesised:
// it stands for the GEMM/attention datapath, reporting `done` when the core's part of the bundle is over.
//   compute = rows x passes, sram_t = ceil(SRAM bytes / SRAM_BPC), slot = max(compute, sram_t)
//   own     = ISSUE_LATENCY + max(slot, dram_t)   (double buffering; else ISSUE_LATENCY + dram_t + slot)
// dram_t is the bundle's DRAM stream (fcar_dram_model). The core is busy in its compute cycles.
module fcar_core_model
  import fcar_pkg::*;
(
  input  logic                  clk,
  input  logic                  rst,
  input  logic                  issue,
  input  logic                  live,
  input  logic [INSTR_BITS-1:0] instr,
  input  logic [MAX_ROWS-1:0]   rows,
  input  logic [31:0]           kvlen,       // run-time context of the instruction's layer (CTX)
  input  logic [63:0]           dram_t,      // cycles of this bundle's DRAM stream (valid with issue)
  // figures of the instruction at issue (combinational)
  output logic [63:0]           compute,
  output logic [63:0]           sram_t,
  output logic [63:0]           dram_bytes,  // per-row traffic of the slot
  output logic [63:0]           wbytes,      // weight tile the slot streams
  output logic [63:0]           macs,
  output logic [1:0]            dclass,      // 1 KV, 2 replay cache, 3 activations (simulate.DRAM_CLASSES)
  // state
  output logic                  done,
  output logic                  busy_now,
  output logic                  own_now
);
  function automatic logic [63:0] cdiv(input logic [63:0] a, input logic [63:0] b);
    cdiv = (a + b - 64'd1) / b;
  endfunction

  logic [7:0]  op, flags, sub;
  logic [63:0] m, k, n, kv, rn, mk, cyc_row, sram_row, dram_row, sram, slot_t;
  logic        ctx, gemm, wgemm, kvgemm, dma;
  always_comb begin
    op = instr[F_OPCODE_LSB +: 8];
    flags = instr[F_FLAGS_LSB +: 8];
    sub = instr[F_SUB_LSB +: 8];
    m = 64'(instr[F_M_LSB +: 32]);
    k = 64'(instr[F_K_LSB +: 32]);
    n = (instr[F_N_LSB +: 16] == 16'd0) ? 64'd1 : 64'(instr[F_N_LSB +: 16]);
    kv = 64'(kvlen);
    rn = '0;
    for (int r = 0; r < MAX_ROWS; r++) rn = rn + 64'(rows[r]);
    if (!live) rn = '0;
    ctx = (flags & FLAG_CTX) != 8'd0;
    gemm = op == OP_GEMM;
    wgemm = gemm && sub == SPACE_WEIGHT;
    kvgemm = gemm && sub != SPACE_WEIGHT;
    dma = op == OP_LOAD || op == OP_STORE || op == OP_XCHG;
    mk = m * k;
    if (ctx) begin
      cyc_row = gemm ? cdiv(kv, 64'(ARRAY_COLS)) * cdiv(k, 64'(ARRAY_ROWS)) * n : cdiv(kv * n, 64'(SFU_LANES));
      sram_row = (kv * k + kv * n) * DTYPE_BYTES;
    end else begin
      if (gemm) cyc_row = cdiv(m, 64'(ARRAY_COLS)) * cdiv(k, 64'(ARRAY_ROWS)) * n;
      else if (op == OP_VEC)
        case (sub)
          VEC_RMSNORM, VEC_ROPE: cyc_row = cdiv(2 * m, 64'(VECTOR_LANES));
          VEC_SOFTMAX:           cyc_row = cdiv(m * n, 64'(SFU_LANES));
          VEC_SILU_MUL:          cyc_row = cdiv(m, 64'(SFU_LANES));
          default:               cyc_row = cdiv(m, 64'(VECTOR_LANES));
        endcase
      else if (op == OP_TAS) cyc_row = cdiv(m * n, 64'(VECTOR_LANES));
      else cyc_row = '0;
      if (gemm) sram_row = (mk + k + m * n) * DTYPE_BYTES;
      else if (op == OP_VEC) sram_row = 3 * m * DTYPE_BYTES;
      else if (op == OP_TAS) sram_row = 2 * m * n * DTYPE_BYTES;
      else if (dma) sram_row = m * DTYPE_BYTES;
      else sram_row = '0;
    end
    compute = rn * cyc_row;
    wbytes = (wgemm && rn != 64'd0) ? mk * DTYPE_BYTES : 64'd0;
    sram = rn * sram_row + wbytes;
    sram_t = cdiv(sram, 64'(SRAM_BPC));
    slot_t = (compute > sram_t) ? compute : sram_t;
    if (dma) dram_row = m * DTYPE_BYTES;
    else if (kvgemm) dram_row = (ctx ? kv : m) * k * DTYPE_BYTES;
    else if (wgemm && (flags & FLAG_SPILL) != 8'd0) dram_row = (k + m) * DTYPE_BYTES;
    else dram_row = '0;
    dram_bytes = rn * dram_row;
    macs = gemm ? rn * (ctx ? kv : m) * k * n : 64'd0;
    if (kvgemm || (dma && (sub == SPACE_KV_K || sub == SPACE_KV_V))) dclass = 2'd1;
    else if (op == OP_XCHG) dclass = 2'd2;
    else dclass = 2'd3;
  end

  logic        act;
  logic [63:0] e, own_end, busy_start, busy_end;
  always_ff @(posedge clk) begin
    if (rst) begin
      act <= 1'b0; e <= '0;
    end else if (issue) begin
      act <= live && rn != 64'd0;
      e <= 64'd1;  // the issue cycle was the first
      if (DOUBLE_BUFFERING) begin
        own_end <= 64'(ISSUE_LATENCY) + ((slot_t > dram_t) ? slot_t : dram_t);
        busy_start <= 64'(ISSUE_LATENCY);
        busy_end <= 64'(ISSUE_LATENCY) + compute;
      end else begin
        own_end <= 64'(ISSUE_LATENCY) + dram_t + slot_t;
        busy_start <= 64'(ISSUE_LATENCY) + dram_t;
        busy_end <= 64'(ISSUE_LATENCY) + dram_t + compute;
      end
    end else if (act && e < own_end) e <= e + 64'd1;
  end
  assign done = !act || e >= own_end;
  assign own_now = act && e < own_end;
  assign busy_now = act && e >= busy_start && e < busy_end;
endmodule
