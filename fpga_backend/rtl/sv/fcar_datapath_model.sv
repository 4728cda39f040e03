// Datapath latency models behind the DRS unit's issue / done interface (not synthesised): per core the MAC array,
// vector unit, SFU and SRAM port; the shared DRAM stream of the bundle. They take the cycles of the execution
// model (simulate.py), written here in integer logic from the same definitions (costmodel.py is the other
// implementation), and report done when their part of the bundle is over:
//   compute = rows x passes       sram_t = ceil(SRAM bytes / SRAM_BPC)       slot = max(compute, sram_t)
//   dram_t  = ceil((weight stream bytes x DRAM_W_MUL + bytes of every slot x DRAM_O_MUL) / DRAM_DIV)
//   core own = ISSUE_LATENCY + max(slot, dram_t)   (double buffering; else ISSUE_LATENCY + dram_t + slot)
//   DRAM     = ISSUE_LATENCY + dram_t
// The figures are worked out once, at issue; a core is busy in its compute cycles and occupied until its own end.
module fcar_datapath_model
  import fcar_pkg::*;
(
  input  logic                        clk,
  input  logic                        rst,
  input  logic                        issue,
  input  logic                        per_core,      // one weight stream per core, else one broadcast
  input  logic [7:0]                  wbits,         // bits per stored weight (the program's weight precision)
  input  logic [CORES-1:0]            live,
  input  logic [CORES*INSTR_BITS-1:0] instr,
  input  logic [CORES*MAX_ROWS-1:0]   rows,
  input  logic [CORES*32-1:0]         kvlen,         // run-time context of each slot's layer (CTX)
  output logic [CORES-1:0]            core_done,
  output logic                        dram_done,
  output logic [CORES-1:0]            busy_now,
  output logic [CORES-1:0]            own_now,
  // figures of the last issued bundle, per core (valid from the cycle after issue)
  output logic [CORES*64-1:0]         f_compute,
  output logic [CORES*64-1:0]         f_dram,
  output logic [CORES*64-1:0]         f_wbytes,
  output logic [CORES*64-1:0]         f_macs,
  output logic [CORES*2-1:0]          f_class       // 1 KV, 2 replay cache, 3 activations
);
  function automatic logic [63:0] cdiv(input logic [63:0] a, input logic [63:0] b);
    cdiv = (a + b - 64'd1) / b;
  endfunction

  // one slot: compute cycles, SRAM cycles, per-row DRAM bytes, weight tile bytes, MACs, DRAM class
  function automatic void slot(input logic [INSTR_BITS-1:0] w, input logic [MAX_ROWS-1:0] rw, input logic lv,
                               input logic [31:0] kvl, input logic [7:0] wb_bits,
                               output logic [63:0] compute, output logic [63:0] slot_t,
                               output logic [63:0] dram, output logic [63:0] wb, output logic [63:0] macs,
                               output logic [1:0] cls);
    logic [7:0]  op, flags, sub;
    logic [63:0] m, k, n, kv, rn, cyc_row, sram_row, dram_row, sram_t, tile;
    logic        ctx, gemm, wgemm, kvgemm, dma;
    op = w[F_OPCODE_LSB +: 8];
    flags = w[F_FLAGS_LSB +: 8];
    sub = w[F_SUB_LSB +: 8];
    m = 64'(w[F_M_LSB +: 32]);
    k = 64'(w[F_K_LSB +: 32]);
    n = (w[F_N_LSB +: 16] == 16'd0) ? 64'd1 : 64'(w[F_N_LSB +: 16]);
    kv = 64'(kvl);
    rn = '0;
    for (int r = 0; r < MAX_ROWS; r++) rn = rn + 64'(rw[r]);
    if (!lv) rn = '0;
    ctx = (flags & FLAG_CTX) != 8'd0;
    gemm = op == OP_GEMM;
    wgemm = gemm && sub == SPACE_WEIGHT;
    kvgemm = gemm && sub != SPACE_WEIGHT;
    dma = op == OP_LOAD || op == OP_STORE || op == OP_XCHG;
    tile = wgemm ? (m * k * 64'(wb_bits) + 64'd7) / 64'd8 : m * k * DTYPE_BYTES;  // weights at their precision
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
      if (gemm) sram_row = tile + (k + m * n) * DTYPE_BYTES;
      else if (op == OP_VEC) sram_row = 3 * m * DTYPE_BYTES;
      else if (op == OP_TAS) sram_row = 2 * m * n * DTYPE_BYTES;
      else if (dma) sram_row = m * DTYPE_BYTES;
      else sram_row = '0;
    end
    compute = rn * cyc_row;
    wb = (wgemm && rn != 64'd0) ? tile : 64'd0;
    sram_t = cdiv(rn * sram_row + wb, 64'(SRAM_BPC));
    slot_t = (compute > sram_t) ? compute : sram_t;
    if (dma) dram_row = m * DTYPE_BYTES;
    else if (kvgemm) dram_row = (ctx ? kv : m) * k * DTYPE_BYTES;
    else if (wgemm && (flags & FLAG_SPILL) != 8'd0) dram_row = (k + m) * DTYPE_BYTES;
    else dram_row = '0;
    dram = rn * dram_row;
    macs = gemm ? rn * (ctx ? kv : m) * k * n : 64'd0;
    if (kvgemm || (dma && (sub == SPACE_KV_K || sub == SPACE_KV_V))) cls = 2'd1;
    else if (op == OP_XCHG) cls = 2'd2;
    else cls = 2'd3;
  endfunction

  logic [CORES-1:0] act;
  logic             d_act;
  logic [63:0]      e, d_end;
  logic [63:0]      own_end [CORES], busy_start [CORES], busy_end [CORES];

  always_ff @(posedge clk) begin
    if (rst) begin
      act <= '0; d_act <= 1'b0; e <= '0;
    end else if (issue) begin : at_issue
      logic [63:0] compute [CORES], slot_t [CORES], dram [CORES], wb [CORES], macs [CORES];
      logic [1:0]  cls [CORES];
      logic [63:0] total, wsum, wmax, dram_t;
      total = '0; wsum = '0; wmax = '0;
      for (int c = 0; c < CORES; c++) begin
        slot(instr[INSTR_BITS*c +: INSTR_BITS], rows[MAX_ROWS*c +: MAX_ROWS], live[c], kvlen[32*c +: 32], wbits,
             compute[c], slot_t[c], dram[c], wb[c], macs[c], cls[c]);
        total = total + dram[c];
        wsum = wsum + wb[c];
        if (wb[c] > wmax) wmax = wb[c];
      end
      total = (per_core ? wsum : wmax) * DRAM_W_MUL + total * DRAM_O_MUL;
      dram_t = (total + DRAM_DIV - 64'd1) / DRAM_DIV;
      e <= 64'd1;  // the issue cycle was the first of the bundle
      d_act <= |live;
      d_end <= 64'(ISSUE_LATENCY) + dram_t;
      for (int c = 0; c < CORES; c++) begin
        act[c] <= live[c];
        if (DOUBLE_BUFFERING) begin
          own_end[c] <= 64'(ISSUE_LATENCY) + ((slot_t[c] > dram_t) ? slot_t[c] : dram_t);
          busy_start[c] <= 64'(ISSUE_LATENCY);
          busy_end[c] <= 64'(ISSUE_LATENCY) + compute[c];
        end else begin
          own_end[c] <= 64'(ISSUE_LATENCY) + dram_t + slot_t[c];
          busy_start[c] <= 64'(ISSUE_LATENCY) + dram_t;
          busy_end[c] <= 64'(ISSUE_LATENCY) + dram_t + compute[c];
        end
        f_compute[64*c +: 64] <= compute[c];
        f_dram[64*c +: 64] <= dram[c];
        f_wbytes[64*c +: 64] <= wb[c];
        f_macs[64*c +: 64] <= macs[c];
        f_class[2*c +: 2] <= cls[c];
      end
    end else e <= e + 64'd1;
  end

  for (genvar c = 0; c < CORES; c++) begin : g_state
    assign core_done[c] = !act[c] || e >= own_end[c];
    assign own_now[c] = act[c] && e < own_end[c];
    assign busy_now[c] = act[c] && e >= busy_start[c] && e < busy_end[c];
  end
  assign dram_done = !d_act || e >= d_end;
endmodule
