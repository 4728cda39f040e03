// DRS dispatcher: fetches bundles (one 256-bit instruction per cycle, the next bundle while the current one
// runs), keeps the Index Register and the layer's row mapping, and issues each bundle's core slots in lock step
// with the row mask every core runs:
//   * a SKIP_ON_REPLAY slot runs the layer's mapping set at DRS_DISPATCH: the static binding's compute rows, or
//     the Mapping Registers' round-robin when drs.py's rule says the remap pays (cfg_drs); a remap holds the
//     bundle DRS_OVERHEAD cycles;
//   * any other slot runs its arg's active rows; a NOP slot or an empty mask is dropped;
//   * with no compute row at DRS_DISPATCH the fetch unit jumps over the layer's replayable phase (its arg).
// A bundle issues in the cycle the previous one completes (every core and the DRAM stream report done); FINISH
// ends the step when its bundle completes. Precondition violations set sticky bits of `err`.
module fcar_dispatch
  import fcar_pkg::*;
#(
  parameter int ADDR_W = 20
) (
  input  logic                        clk,
  input  logic                        rst,
  // host registers
  input  logic [MAX_ROWS-1:0]         cfg_active,
  input  logic [CORES*MAX_ROWS-1:0]   cfg_binding,
  input  logic                        cfg_drs,       // DRS policy (0: static binding)
  input  logic                        cfg_per_core,  // one weight stream per core (drs.py rule)
  input  logic                        prog_reset,    // a program is being loaded: forget the fetched one
  input  logic                        prog_valid,
  input  logic [31:0]                 n_bundles,
  // steps
  input  logic                        start,
  output logic                        running,
  output logic                        step_done,
  // program memory (registered read: data one cycle after the address)
  output logic                        imem_re,
  output logic [ADDR_W-1:0]           imem_raddr,
  input  logic [INSTR_BITS-1:0]       imem_rdata,
  // TAS datapath: the scores of the head bundle's TAS layer
  output logic [15:0]                 tas_layer,
  input  logic [MAX_ROWS*32-1:0]      tas_score,
  input  logic [MAX_ROWS-1:0]         tas_valid,
  // issue to the cores
  output logic                        issue,
  output logic [31:0]                 issue_pc,
  output logic                        issue_remap,
  output logic [CORES-1:0]            slot_live,
  output logic [CORES*INSTR_BITS-1:0] slot_instr,
  output logic [CORES*MAX_ROWS-1:0]   slot_rows,
  output logic                        remapping,     // in a remap's DRS_OVERHEAD cycles
  output logic                        remap_start,   // first of them (the DISPATCH bundle begins)
  output logic                        stalled,       // ready to issue but the bundle or its mapping is not
  input  logic [CORES-1:0]            core_done,
  input  logic                        dram_done,
  // DRS state, for the monitor
  output logic                        drs_set,       // one cycle after a DRS_SET: drs_layer / latched valid
  output logic [15:0]                 drs_layer,
  output logic [MAX_ROWS-1:0]         latched,
  // MLP-cache ports
  output logic [CORES-1:0]            cache_valid,
  output logic [CORES-1:0]            cache_read,
  output logic [CORES*ROW_BITS-1:0]   cache_row,
  output logic [CORES*64-1:0]         cache_bytes,
  output logic [MAX_ROWS*((CORES > 1) ? $clog2(CORES) : 1)-1:0] mapping,
  output logic [7:0]                  err
);
  localparam int CB = (CORES > 1) ? $clog2(CORES) : 1;
  localparam int SB = $clog2(SLOTS + 1);
  // err bits
  localparam int E_SKIP_UNMAPPED = 0;   // a SKIP_ON_REPLAY slot of a layer without a DRS_DISPATCH
  localparam int E_DISPATCH_NO_SET = 1; // DRS_DISPATCH without its layer's DRS_SET
  localparam int E_SET_NO_TAS = 2;      // DRS_SET FROM_TAS without a TAS of its layer
  localparam int E_JUMP = 3;            // a jump beyond the program
  localparam int E_CACHE = 4;           // MLP-cache port overrun

  // TAS comparison: a row replays when its score is valid (the replay cache holds its slot one frame back) and
  // exceeds tau as an IEEE-754 single (score > tau; NaN never, +0 == -0), the rule of functional.py's TAS.
  // Functions, evaluated at issue.
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

  // ---------------------------------------------------------------- fetch
  logic [INSTR_BITS-1:0] bufw [SLOTS];
  logic                  buf_valid, f_busy, cap_valid;
  logic [31:0]           buf_pc, f_pc;
  logic [SB-1:0]         f_req, cap_slot;
  logic [15:0]           drs_layer_r;
  logic                  drs_valid;

  assign imem_re    = f_busy && f_req < SB'(SLOTS);
  assign imem_raddr = ADDR_W'(f_pc * 32'(SLOTS) + 32'(f_req));

  // a fetched DRS_DISPATCH whose layer has no compute row: jump over its replayable phase
  logic [7:0]  cap_op;
  logic [15:0] cap_layer;
  logic [31:0] cap_arg;
  logic        jump;
  assign cap_op    = imem_rdata[F_OPCODE_LSB +: 8];
  assign cap_layer = imem_rdata[F_LAYER_LSB +: 16];
  assign cap_arg   = imem_rdata[F_ARG_LSB +: 32];
  assign jump = cap_valid && cap_slot == SB'(SLOTS - 1) && cap_op == OP_DRS_DISPATCH && drs_valid &&
                drs_layer_r == cap_layer && latched == '0 && cap_arg != 32'd0;

  // ---------------------------------------------------------------- head bundle
  logic [7:0]  ctl_op, ctl_flags;
  logic [15:0] ctl_layer;
  logic [31:0] ctl_arg;
  logic [127:0] ctl_thr;  // m, k, off_m, off_k: 16 threshold bytes
  assign ctl_op    = bufw[SLOTS-1][F_OPCODE_LSB +: 8];
  assign ctl_flags = bufw[SLOTS-1][F_FLAGS_LSB +: 8];
  assign ctl_layer = bufw[SLOTS-1][F_LAYER_LSB +: 16];
  assign ctl_arg   = bufw[SLOTS-1][F_ARG_LSB +: 32];
  assign ctl_thr   = {bufw[SLOTS-1][F_OFF_K_LSB +: 32], bufw[SLOTS-1][F_OFF_M_LSB +: 32],
                      bufw[SLOTS-1][F_K_LSB +: 32], bufw[SLOTS-1][F_M_LSB +: 32]};
  logic head_dispatch;
  assign head_dispatch = ctl_op == OP_DRS_DISPATCH;

  // ---------------------------------------------------------------- Index Register, TAS, row queues
  logic [MAX_ROWS-1:0] tas_idx;
  logic [15:0]         tas_l;
  logic                tas_ok;
  logic [127:0]        thr_lo;     // thr[1..16] of the last DRS_SET
  logic [15:0]         thr_layer;
  logic                rq_load, rq_ready, rq_differ;
  logic [5:0]          rq_n, rq_smax, rq_as, rq_ad;
  logic [CORES*MAX_ROWS-1:0] rq_st, rq_drs;
  logic [MAX_ROWS-1:0] rq_replay;
  logic [CORES*MAX_ROWS-1:0] lmask;  // the mapping in force
  logic [15:0]         map_layer;
  logic                map_valid;

  // the Index Register a DRS_SET at the head latches: from the TAS unit, or its immediate arg
  logic [MAX_ROWS-1:0] set_idx;
  logic                set_tas_ok;
  assign set_tas_ok = tas_ok && tas_l == ctl_layer;
  assign set_idx = (((ctl_flags & FLAG_FROM_TAS) != 8'd0) ? (set_tas_ok ? tas_idx : ALL_ROWS) : ctl_arg) & cfg_active;

  fcar_rowq #(.CB(CB)) u_rowq (
    .clk, .rst, .load(rq_load), .index(set_idx), .active(cfg_active), .binding(cfg_binding),
    .ready(rq_ready), .n(rq_n), .s_max(rq_smax), .a_s(rq_as), .a_d(rq_ad), .differ(rq_differ),
    .st_mask(rq_st), .drs_mask(rq_drs), .replay_mask(rq_replay), .mapping(mapping));

  // drs.py's rule: remap iff n > 0 and s >= thr[n] (per-core streams: and A_d <= A_s) and the masks differ
  logic [7:0] thr_n;
  logic       dec_ok, dec_remap;
  always_comb begin
    if (rq_n == 6'd0) thr_n = THR_NEVER;
    else if (rq_n <= 6'(THR_PER_INSTR))
      thr_n = (thr_layer == ctl_layer) ? thr_lo[8*(rq_n - 6'd1) +: 8] : THR_NEVER;
    else thr_n = ctl_thr[8*(rq_n - 6'(THR_PER_INSTR) - 6'd1) +: 8];
  end
  assign dec_ok    = drs_valid && drs_layer_r == ctl_layer;
  assign dec_remap = cfg_drs && dec_ok && rq_n != 6'd0 && {2'd0, rq_smax} >= thr_n &&
                     (!cfg_per_core || rq_ad <= rq_as) && rq_differ;

  // ---------------------------------------------------------------- slots of the head bundle
  logic                      in_remap;
  logic [CORES*MAX_ROWS-1:0] cur_mask;
  logic [CORES-1:0]          unmapped, is_skip, is_tas, mapped;
  logic                      tas_any;
  logic [7:0]                s_op [CORES];
  logic [15:0]               s_layer [CORES];
  assign cur_mask = head_dispatch ? (dec_remap || in_remap ? rq_drs : rq_st) : lmask;
  for (genvar c = 0; c < CORES; c++) begin : g_slot
    assign s_op[c]    = bufw[c][F_OPCODE_LSB +: 8];
    assign s_layer[c] = bufw[c][F_LAYER_LSB +: 16];
    assign is_skip[c] = (bufw[c][F_FLAGS_LSB +: 8] & FLAG_SKIP_ON_REPLAY) != 8'd0;
    assign mapped[c]  = head_dispatch ? (dec_ok && s_layer[c] == ctl_layer) : (map_valid && map_layer == s_layer[c]);
    assign slot_rows[MAX_ROWS*c +: MAX_ROWS] = is_skip[c] ? (mapped[c] ? cur_mask[MAX_ROWS*c +: MAX_ROWS] : '0)
                                                          : bufw[c][F_ARG_LSB +: 32] & cfg_active;
    assign unmapped[c] = is_skip[c] && !mapped[c] && s_op[c] != OP_NOP;
    assign slot_live[c] = s_op[c] != OP_NOP && slot_rows[MAX_ROWS*c +: MAX_ROWS] != '0;
    assign slot_instr[INSTR_BITS*c +: INSTR_BITS] = bufw[c];
    assign is_tas[c] = s_op[c] == OP_TAS;
  end
  always_comb begin
    tas_layer = '0; tas_any = 1'b0;
    for (int c = CORES - 1; c >= 0; c--)
      if (is_tas[c]) begin tas_layer = s_layer[c]; tas_any = 1'b1; end
  end

  // ---------------------------------------------------------------- issue control
  typedef enum logic [1:0] {S_IDLE, S_RUN, S_REMAP} state_e;
  state_e st;
  logic inflight, fin_pending;
  logic [31:0] rem_cnt;
  logic all_done, can_go, need_map, do_issue, enter_remap;
  assign in_remap   = st == S_REMAP;
  assign all_done   = (&core_done) && dram_done;
  assign can_go     = !inflight || all_done;
  assign need_map   = head_dispatch && dec_ok && !rq_ready;  // mapping still being built
  assign enter_remap = st == S_RUN && can_go && !(inflight && fin_pending) && buf_valid && !need_map &&
                       head_dispatch && dec_remap;
  assign do_issue   = (st == S_RUN && can_go && !(inflight && fin_pending) && buf_valid && !need_map &&
                       !(head_dispatch && dec_remap)) || (st == S_REMAP && rem_cnt == 32'd0);
  assign issue       = do_issue;
  assign issue_pc    = buf_pc;
  assign issue_remap = st == S_REMAP;
  assign remapping   = st == S_REMAP;
  assign remap_start = enter_remap;
  assign running     = st != S_IDLE;
  assign stalled     = st == S_RUN && can_go && !(inflight && fin_pending) && (!buf_valid || need_map);
  assign rq_load     = do_issue && ctl_op == OP_DRS_SET;
  assign drs_layer   = drs_layer_r;

  // MLP-cache ports
  logic [CORES-1:0] cp_overrun;
  for (genvar c = 0; c < CORES; c++) begin : g_cache
    fcar_cacheport u_port (
      .clk, .rst,
      .start(do_issue && slot_live[c] && s_op[c] == OP_XCHG),
      .rows(slot_rows[MAX_ROWS*c +: MAX_ROWS]),
      .replay((drs_valid && drs_layer_r == s_layer[c]) ? ~latched : '0),
      .m(bufw[c][F_M_LSB +: 32]), .busy(), .req_valid(cache_valid[c]), .req_read(cache_read[c]),
      .req_row(cache_row[ROW_BITS*c +: ROW_BITS]), .req_bytes(cache_bytes[64*c +: 64]), .overrun(cp_overrun[c]));
  end

  always_ff @(posedge clk) begin
    step_done <= 1'b0;
    drs_set <= 1'b0;
    if (rst || prog_reset) begin
      st <= S_IDLE; inflight <= 1'b0; fin_pending <= 1'b0; buf_valid <= 1'b0; f_busy <= 1'b0;
      cap_valid <= 1'b0; f_pc <= '0; drs_valid <= 1'b0; map_valid <= 1'b0; tas_ok <= 1'b0; err <= '0;
      latched <= '0; thr_layer <= NO_LAYER; drs_layer_r <= NO_LAYER;
    end else begin
      // ---- fetch
      if (f_busy) begin
        if (f_req < SB'(SLOTS)) f_req <= f_req + 1'b1;
        cap_valid <= f_req < SB'(SLOTS);
        cap_slot <= f_req;
      end else cap_valid <= 1'b0;
      if (cap_valid) begin
        bufw[cap_slot] <= imem_rdata;
        if (cap_slot == SB'(SLOTS - 1)) begin
          f_busy <= 1'b0;
          cap_valid <= 1'b0;
          if (jump) begin
            f_pc <= f_pc + cap_arg;
            if (f_pc + cap_arg >= n_bundles) err[E_JUMP] <= 1'b1;
          end else begin
            buf_valid <= 1'b1;
            buf_pc <= f_pc;
          end
        end
      end
      if (!f_busy && !cap_valid && !buf_valid && prog_valid && f_pc < n_bundles) begin
        f_busy <= 1'b1;
        f_req <= '0;
      end
      // ---- steps
      case (st)
        S_IDLE: if (start && prog_valid) begin
          st <= S_RUN; inflight <= 1'b0; fin_pending <= 1'b0; tas_ok <= 1'b0; drs_valid <= 1'b0;
          map_valid <= 1'b0; thr_layer <= NO_LAYER;
        end
        S_RUN: begin
          if (inflight && fin_pending && all_done) begin
            st <= S_IDLE; inflight <= 1'b0; fin_pending <= 1'b0; step_done <= 1'b1;
          end else if (enter_remap) begin
            st <= S_REMAP; inflight <= 1'b0; rem_cnt <= 32'(DRS_OVERHEAD - 1);
          end
        end
        S_REMAP: if (rem_cnt != 32'd0) rem_cnt <= rem_cnt - 32'd1; else st <= S_RUN;
        default: st <= S_IDLE;
      endcase
      if (do_issue) begin
        inflight <= 1'b1;
        fin_pending <= ctl_op == OP_FINISH;
        buf_valid <= 1'b0;
        f_pc <= (ctl_op == OP_FINISH) ? 32'd0 : buf_pc + 32'd1;
        if (|unmapped) err[E_SKIP_UNMAPPED] <= 1'b1;
        if (tas_any) begin : tas_compare
          logic [MAX_ROWS-1:0] clear;
          clear = '0;
          for (int c = 0; c < CORES; c++)
            if (is_tas[c] && slot_live[c])
              clear = clear | (slot_rows[MAX_ROWS*c +: MAX_ROWS] &
                               tas_replay(tas_score, tas_valid, bufw[c][F_OFF_M_LSB +: 32]));
          tas_idx <= ((tas_ok && tas_l == tas_layer) ? tas_idx : ALL_ROWS) & ~clear;
          tas_l <= tas_layer;
          tas_ok <= 1'b1;
        end
        case (ctl_op)
          OP_DRS_SET: begin
            latched <= set_idx;
            if ((ctl_flags & FLAG_FROM_TAS) != 8'd0 && !set_tas_ok) err[E_SET_NO_TAS] <= 1'b1;
            drs_layer_r <= ctl_layer; drs_valid <= 1'b1; drs_set <= 1'b1;
            thr_lo <= ctl_thr; thr_layer <= ctl_layer;
          end
          OP_DRS_DISPATCH: begin
            if (!dec_ok) err[E_DISPATCH_NO_SET] <= 1'b1;
            lmask <= cur_mask; map_layer <= ctl_layer; map_valid <= dec_ok;
          end
          OP_FINISH: begin drs_valid <= 1'b0; map_valid <= 1'b0; end
          default: ;
        endcase
      end
      if (|cp_overrun) err[E_CACHE] <= 1'b1;
    end
  end
endmodule
