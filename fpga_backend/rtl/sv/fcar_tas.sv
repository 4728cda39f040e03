// TAS comparison: which rows replay, from the TAS datapath's scores. A row replays when its score is valid (the
// replay cache holds its slot one frame back) and exceeds tau as an IEEE-754 single (score > tau; NaN never,
// +0 == -0), the rule of functional.py's TAS. Functions, so the dispatcher evaluates them at issue only.
package fcar_tas_pkg;
  import fcar_pkg::*;

  function automatic logic f32_gt(input logic [31:0] a, input logic [31:0] b);
    logic [31:0] ka, kb;
    logic nan;
    nan = (a[30:23] == 8'hFF && a[22:0] != 23'd0) || (b[30:23] == 8'hFF && b[22:0] != 23'd0);
    ka = a[31] ? ~a : (a | 32'h8000_0000);  // order-preserving keys of sign-magnitude floats
    kb = b[31] ? ~b : (b | 32'h8000_0000);
    f32_gt = !nan && !(a[30:0] == 31'd0 && b[30:0] == 31'd0) && ka > kb;
  endfunction

  function automatic logic [MAX_ROWS-1:0] tas_replay(input logic [MAX_ROWS*32-1:0] score,
                                                     input logic [MAX_ROWS-1:0] valid, input logic [31:0] tau);
    for (int r = 0; r < MAX_ROWS; r++) tas_replay[r] = valid[r] && f32_gt(score[32*r +: 32], tau);
  endfunction
endpackage
