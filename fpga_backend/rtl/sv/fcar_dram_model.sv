// Latency model of the shared DRAM stream of a bundle: every core's per-row traffic plus the weight tiles (one
// broadcast stream: the largest tile once; per-core streams: every tile), moved at DRAM_NUM / DRAM_DEN bytes per
// cycle after the issue latency; done when the last byte has arrived (ceil: whole cycles). Not synthesised.
module fcar_dram_model
  import fcar_pkg::*;
(
  input  logic              clk,
  input  logic              rst,
  input  logic              issue,
  input  logic              per_core,
  input  logic [CORES-1:0]  live,
  input  logic [CORES*64-1:0] dram_bytes,
  input  logic [CORES*64-1:0] wbytes,
  output logic [63:0]       dram_t,     // cycles of the stream of the bundle being issued (combinational)
  output logic [63:0]       total,      // its bytes
  output logic              done
);
  logic [63:0] w, wmax;
  always_comb begin
    total = '0; w = '0; wmax = '0;
    for (int c = 0; c < CORES; c++) begin
      total = total + dram_bytes[64*c +: 64];
      w = w + wbytes[64*c +: 64];
      if (wbytes[64*c +: 64] > wmax) wmax = wbytes[64*c +: 64];
    end
    total = total + (per_core ? w : wmax);
    dram_t = (total * DRAM_DEN + DRAM_NUM - 64'd1) / DRAM_NUM;
  end

  logic        act;
  logic [63:0] e, end_t;
  always_ff @(posedge clk) begin
    if (rst) begin
      act <= 1'b0; e <= '0;
    end else if (issue) begin
      act <= |live;
      e <= 64'd1;
      end_t <= 64'(ISSUE_LATENCY) + dram_t;
    end else if (act && e < end_t) e <= e + 64'd1;
  end
  assign done = !act || e >= end_t;
endmodule
