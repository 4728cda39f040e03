// Row queues and Mapping Registers. At DRS_SET the latched Index Register is scanned one row per cycle into the
// compute queue (bit 1) or the skip queue (an active row with bit 0). The allocator pops the compute queue into
// the 32 Mapping Registers, the i-th compute row to core i mod CORES (schedule.mapping_registers); the skip
// queue drains into the replay mask the MLP-cache read ports serve. When both queues are empty the remap
// figures the dispatcher's rule reads (drs.py) are registered: n, the static masks (binding & Index Register),
// their busiest core s and active cores A_s, the round-robin masks and their active cores A_d.
module fcar_rowq
  import fcar_pkg::*;
#(
  parameter int CB = (CORES > 1) ? $clog2(CORES) : 1
) (
  input  logic                      clk,
  input  logic                      rst,
  input  logic                      load,        // one cycle: DRS_SET latches `index`
  input  logic [MAX_ROWS-1:0]       index,       // compute rows (active rows only)
  input  logic [MAX_ROWS-1:0]       active,
  input  logic [CORES*MAX_ROWS-1:0] binding,
  output logic                      ready,
  output logic [5:0]                n,
  output logic [5:0]                s_max,
  output logic [5:0]                a_s,
  output logic [5:0]                a_d,
  output logic                      differ,
  output logic [CORES*MAX_ROWS-1:0] st_mask,
  output logic [CORES*MAX_ROWS-1:0] drs_mask,
  output logic [MAX_ROWS-1:0]       replay_mask,
  output logic [MAX_ROWS*CB-1:0]    mapping      // Mapping Register r: core of compute row r
);

  logic [ROW_BITS-1:0] cq [MAX_ROWS];
  logic [ROW_BITS-1:0] sq [MAX_ROWS];
  logic [5:0] cq_head, cq_tail, sq_head, sq_tail;
  logic [5:0] scan;
  logic       scanning, summing;
  logic [CB-1:0] rr;
  logic [MAX_ROWS-1:0] idx;

  function automatic logic [5:0] popcount(input logic [MAX_ROWS-1:0] v);
    logic [5:0] c;
    c = '0;
    for (int i = 0; i < MAX_ROWS; i++) c = c + {5'd0, v[i]};
    popcount = c;
  endfunction

  logic [5:0] smax_c, as_c, ad_c;
  logic       df_c;
  always_comb begin  // the remap figures of the masks built so far
    smax_c = '0; as_c = '0; ad_c = '0; df_c = 1'b0;
    for (int c = 0; c < CORES; c++) begin
      if (popcount(st_mask[MAX_ROWS*c +: MAX_ROWS]) > smax_c) smax_c = popcount(st_mask[MAX_ROWS*c +: MAX_ROWS]);
      if (st_mask[MAX_ROWS*c +: MAX_ROWS] != '0) as_c = as_c + 6'd1;
      if (drs_mask[MAX_ROWS*c +: MAX_ROWS] != '0) ad_c = ad_c + 6'd1;
      if (st_mask[MAX_ROWS*c +: MAX_ROWS] != drs_mask[MAX_ROWS*c +: MAX_ROWS]) df_c = 1'b1;
    end
  end

  always_ff @(posedge clk) begin
    if (rst) begin
      ready <= 1'b0; scanning <= 1'b0; summing <= 1'b0;
    end else if (load) begin
      ready <= 1'b0; scanning <= 1'b1; summing <= 1'b0; scan <= '0; idx <= index;
      cq_head <= '0; cq_tail <= '0; sq_head <= '0; sq_tail <= '0; rr <= '0;
      drs_mask <= '0; replay_mask <= '0;
      for (int c = 0; c < CORES; c++) st_mask[MAX_ROWS*c +: MAX_ROWS] <= binding[MAX_ROWS*c +: MAX_ROWS] & index;
      mapping <= '0;
    end else begin
      if (scanning) begin  // one row per cycle into its queue
        if (idx[scan[ROW_BITS-1:0]]) begin
          cq[cq_tail[ROW_BITS-1:0]] <= scan[ROW_BITS-1:0];
          cq_tail <= cq_tail + 6'd1;
        end else if (active[scan[ROW_BITS-1:0]]) begin
          sq[sq_tail[ROW_BITS-1:0]] <= scan[ROW_BITS-1:0];
          sq_tail <= sq_tail + 6'd1;
        end
        if (scan == 6'(MAX_ROWS - 1)) scanning <= 1'b0;
        scan <= scan + 6'd1;
      end
      if (cq_head != cq_tail) begin  // allocator: round-robin over the cores
        mapping[CB*cq[cq_head[ROW_BITS-1:0]] +: CB] <= rr;
        drs_mask[MAX_ROWS * 32'(rr) + 32'(cq[cq_head[ROW_BITS-1:0]])] <= 1'b1;
        rr <= (rr == CB'(CORES - 1)) ? '0 : rr + 1'b1;
        cq_head <= cq_head + 6'd1;
      end
      if (sq_head != sq_tail) begin  // skip queue: rows the MLP cache serves
        replay_mask[sq[sq_head[ROW_BITS-1:0]]] <= 1'b1;
        sq_head <= sq_head + 6'd1;
      end
      if (!scanning && !summing && !ready && cq_head == cq_tail && sq_head == sq_tail) summing <= 1'b1;
      if (summing) begin
        summing <= 1'b0;
        ready <= 1'b1;
        n <= popcount(idx);
        s_max <= smax_c; a_s <= as_c; a_d <= ad_c; differ <= df_c;
      end
    end
  end
endmodule
