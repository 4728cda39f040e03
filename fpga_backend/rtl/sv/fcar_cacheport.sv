// MLP-cache port of one core: an XCHG walks its rows one per cycle; a replayed row is a read request (the cached
// MLP output comes back), a computed row a write request (the fresh output goes in), m x DTYPE_BYTES each.
module fcar_cacheport
  import fcar_pkg::*;
(
  input  logic                clk,
  input  logic                rst,
  input  logic                start,      // one cycle: XCHG issued on this core
  input  logic [MAX_ROWS-1:0] rows,
  input  logic [MAX_ROWS-1:0] replay,     // rows whose Index Register bit is 0
  input  logic [31:0]         m,
  output logic                busy,
  output logic                req_valid,
  output logic                req_read,
  output logic [ROW_BITS-1:0] req_row,
  output logic [63:0]         req_bytes,
  output logic                overrun     // a new XCHG arrived before the last one was walked
);
  logic [MAX_ROWS-1:0] left, rep;
  logic [63:0] bytes;
  logic [ROW_BITS-1:0] low;
  always_comb begin
    low = '0;
    for (int r = MAX_ROWS - 1; r >= 0; r--) if (left[r]) low = ROW_BITS'(r);
  end
  assign busy = left != '0;

  always_ff @(posedge clk) begin
    req_valid <= 1'b0;
    if (rst) begin
      left <= '0; overrun <= 1'b0;
    end else if (start) begin
      if (busy) overrun <= 1'b1;
      left <= rows; rep <= replay; bytes <= 64'(m) * 64'(DTYPE_BYTES);
    end else if (busy) begin
      req_valid <= 1'b1; req_read <= rep[low]; req_row <= low; req_bytes <= bytes;
      left[low] <= 1'b0;
    end
  end
endmodule
