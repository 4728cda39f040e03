// Co-simulation top (Verilator + cocotb; not synthesised): the DRS unit with the core and DRAM latency models,
// the program memory, the host-side memories (the .fcb image streamed to the loader, per step and layer the
// KV length and the TAS datapath's scores) and a monitor writing every event to +LOG. cocotb (cosim_bench.py)
// drives the host registers, the loads and the steps; fcar_main.cpp drives the clock.
module tb_top
  import fcar_pkg::*;
#(
  parameter int ADDR_W = 20,        // program memory: 2^ADDR_W instructions
  parameter int FILE_W = 23,        // file image: 2^FILE_W 32-bit words
  parameter int STEP_W = 16         // steps x layers of KV lengths and TAS scores
) (
  input logic clk  // driven by fcar_main.cpp: one cycle per 2 ns time slot
);
  localparam int CB = (CORES > 1) ? $clog2(CORES) : 1;


  // ---- host registers (written by cocotb)
  logic                      rst          /*verilator public_flat_rw*/ = 1'b1;
  logic                      load_go      /*verilator public_flat_rw*/ = 1'b0;
  logic [31:0]               load_off     /*verilator public_flat_rw*/ = '0;  // file image word offset
  logic [31:0]               load_len     /*verilator public_flat_rw*/ = '0;  // bytes
  logic [MAX_ROWS-1:0]       cfg_active   /*verilator public_flat_rw*/ = '0;
  logic [CORES*MAX_ROWS-1:0] cfg_binding  /*verilator public_flat_rw*/ = '0;
  logic                      cfg_drs      /*verilator public_flat_rw*/ = 1'b0;
  logic                      cfg_per_core /*verilator public_flat_rw*/ = 1'b0;
  logic [7:0]                cfg_wbits    /*verilator public_flat_rw*/ = 8'(8 * DTYPE_BYTES);
  logic [31:0]               n_layers     /*verilator public_flat_rw*/ = 32'd1;
  logic [31:0]               step_base    /*verilator public_flat_rw*/ = '0;  // row of this step in the step memories
  logic [31:0]               log_tag      /*verilator public_flat_rw*/ = '0;
  logic                      start        /*verilator public_flat_rw*/ = 1'b0;
  // ---- results (read by cocotb)
  logic                      load_done    /*verilator public_flat_rw*/;
  logic [3:0]                refusal      /*verilator public_flat_rw*/;
  logic [2:0]                fault        /*verilator public_flat_rw*/;
  logic [31:0]               fault_index  /*verilator public_flat_rw*/;
  logic                      step_done    /*verilator public_flat_rw*/;
  logic [7:0]                err          /*verilator public_flat_rw*/;
  logic [63:0]               cyc          /*verilator public_flat_rw*/ = '0;

  // ---- memories
  logic [31:0]             fmem [2**FILE_W];
  logic [INSTR_BITS-1:0]   imem [2**ADDR_W];
  logic [31:0]             kvmem [2**STEP_W];
  logic [MAX_ROWS*32-1:0]  smem [2**STEP_W];
  logic [MAX_ROWS-1:0]     vmem [2**STEP_W];
  integer fd;
  string  path;
  initial begin
    if ($value$plusargs("FILE=%s", path)) $readmemh(path, fmem);
    if ($value$plusargs("KVLEN=%s", path)) $readmemh(path, kvmem);
    if ($value$plusargs("SCORES=%s", path)) $readmemh(path, smem);
    if ($value$plusargs("VALID=%s", path)) $readmemh(path, vmem);
    fd = 0;
    if ($value$plusargs("LOG=%s", path)) fd = $fopen(path, "w");
  end

  // ---- file streamer: one 4-byte beat per cycle
  logic        in_valid;
  logic [31:0] in_data, beats_left, fptr;
  always_ff @(posedge clk) begin
    if (rst) begin
      in_valid <= 1'b0; beats_left <= '0;
    end else if (load_go) begin
      beats_left <= (load_len + 32'd3) >> 2; fptr <= load_off; in_valid <= 1'b0;
    end else if (beats_left != '0) begin
      in_valid <= 1'b1; in_data <= fmem[fptr[FILE_W-1:0]]; fptr <= fptr + 32'd1; beats_left <= beats_left - 32'd1;
    end else in_valid <= 1'b0;
  end

  // ---- the DRS unit
  logic                        imem_we, imem_re, issue, issue_remap, remapping, remap_start, stalled, running;
  logic                        prog_valid;
  logic                        load_busy, drs_set, dram_done;
  logic [ADDR_W-1:0]           imem_waddr, imem_raddr;
  logic [INSTR_BITS-1:0]       imem_wdata, imem_rdata;
  logic [15:0]                 tas_layer, drs_layer;
  logic [MAX_ROWS-1:0]         latched;
  logic [31:0]                 issue_pc;
  logic [CORES-1:0]            slot_live, core_done, cache_valid, cache_read, busy_now, own_now;
  logic [CORES*INSTR_BITS-1:0] slot_instr;
  logic [CORES*MAX_ROWS-1:0]   slot_rows;
  logic [CORES*ROW_BITS-1:0]   cache_row;
  logic [CORES*64-1:0]         cache_bytes;
  logic [MAX_ROWS*CB-1:0]      mapping;
  logic [MAX_ROWS*32-1:0]      tas_score;
  logic [MAX_ROWS-1:0]         tas_valid;

  fcar_drs #(.ADDR_W(ADDR_W)) u_drs (
    .clk, .rst, .load_go, .load_len, .in_valid, .in_data, .load_busy, .load_done, .refusal, .fault, .fault_index,
    .prog_valid, .imem_we, .imem_waddr, .imem_wdata, .imem_re, .imem_raddr, .imem_rdata, .cfg_active,
    .cfg_binding, .cfg_drs, .cfg_per_core, .start, .running, .step_done, .tas_layer, .tas_score, .tas_valid,
    .issue, .issue_pc, .issue_remap, .slot_live, .slot_instr, .slot_rows, .remapping, .remap_start, .stalled, .core_done,
    .dram_done, .drs_set, .drs_layer, .latched, .cache_valid, .cache_read, .cache_row, .cache_bytes, .mapping, .err);

  always_ff @(posedge clk) begin
    if (imem_we) imem[imem_waddr] <= imem_wdata;
    if (imem_re) imem_rdata <= imem[imem_raddr];
  end

  function automatic logic [31:0] step_row(input logic [15:0] layer);
    logic [31:0] l;
    l = (layer == NO_LAYER) ? n_layers : 32'(layer);
    if (l >= n_layers) l = n_layers - 32'd1;
    step_row = step_base + l;
  endfunction
  assign tas_score = smem[step_row(tas_layer)];
  assign tas_valid = vmem[step_row(tas_layer)];

  // ---- datapath latency models
  logic [CORES*32-1:0] kvlen;
  logic [CORES*64-1:0] f_compute, f_dram, f_wbytes, f_macs;
  logic [CORES*2-1:0]  f_class;
  for (genvar c = 0; c < CORES; c++) begin : g_kv
    assign kvlen[32*c +: 32] = kvmem[step_row(slot_instr[INSTR_BITS*c + F_LAYER_LSB +: 16])];
  end
  fcar_datapath_model u_model (
    .clk, .rst, .issue, .per_core(cfg_per_core), .wbits(cfg_wbits), .live(slot_live), .instr(slot_instr), .rows(slot_rows), .kvlen,
    .core_done, .dram_done, .busy_now, .own_now, .f_compute, .f_dram, .f_wbytes, .f_macs, .f_class);

  // ---- monitor: P step begin, B bundle start, S issued slot, C core cycles of the bundle, R Index Register,
  //      X MLP-cache request, E step end (cycle, stall cycles, err)
  logic        open_b, issued_q;
  logic [CORES-1:0]    live_q;
  logic [7:0]          op_q [CORES], sub_q [CORES];
  logic [15:0]         layer_q [CORES];
  logic [MAX_ROWS-1:0] rows_q [CORES];
  logic [63:0] acc_busy [CORES], acc_own [CORES];
  logic [63:0] stall_cnt;
  logic        bstart;
  assign bstart = (issue && !issue_remap) || remap_start;
  always_ff @(posedge clk) begin
    cyc <= cyc + 64'd1;
    if (rst) begin
      open_b <= 1'b0; stall_cnt <= '0;
    end else begin
      if (start && fd != 0) $fwrite(fd, "P %0d %0d %0d\n", log_tag, step_base, cyc);
      // issued slots: logged the cycle after issue, with the figures the models registered
      issued_q <= issue;
      live_q <= slot_live;
      for (int c = 0; c < CORES; c++) begin
        op_q[c] <= slot_instr[INSTR_BITS*c + F_OPCODE_LSB +: 8];
        sub_q[c] <= slot_instr[INSTR_BITS*c + F_SUB_LSB +: 8];
        layer_q[c] <= slot_instr[INSTR_BITS*c + F_LAYER_LSB +: 16];
        rows_q[c] <= slot_rows[MAX_ROWS*c +: MAX_ROWS];
      end
      if (issued_q && fd != 0)
        for (int c = 0; c < CORES; c++)
          if (live_q[c])
            $fwrite(fd, "S %0d %0d %0d %0d %h %0d %0d %0d %0d %0d\n", c, op_q[c], sub_q[c], layer_q[c], rows_q[c],
                    f_compute[64*c +: 64], f_dram[64*c +: 64], f_wbytes[64*c +: 64], f_macs[64*c +: 64],
                    f_class[2*c +: 2]);
      if ((bstart || step_done) && open_b && fd != 0)
        for (int c = 0; c < CORES; c++) $fwrite(fd, "C %0d %0d %0d\n", c, acc_busy[c], acc_own[c]);
      if (bstart) begin
        if (fd != 0) $fwrite(fd, "B %0d %0d %0d\n", cyc, issue_pc, remap_start);
        open_b <= 1'b1;
        for (int c = 0; c < CORES; c++) begin
          acc_busy[c] <= '0;
          acc_own[c] <= (issue && slot_live[c]) ? 64'd1 : 64'd0;
        end
      end else
        for (int c = 0; c < CORES; c++) begin
          acc_busy[c] <= acc_busy[c] + 64'(busy_now[c]);
          acc_own[c] <= acc_own[c] + 64'(own_now[c]) + 64'(issue && slot_live[c]);
        end
      if (drs_set && fd != 0) $fwrite(fd, "R %0d %h\n", drs_layer, latched);
      for (int c = 0; c < CORES; c++)
        if (cache_valid[c] && fd != 0)
          $fwrite(fd, "X %0d %0d %0d %0d\n", c, cache_read[c], cache_row[ROW_BITS*c +: ROW_BITS],
                  cache_bytes[64*c +: 64]);
      if (stalled) stall_cnt <= stall_cnt + 64'd1;
      if (step_done) begin
        // step_done is registered: the FINISH bundle completed in the cycle before
        if (fd != 0) $fwrite(fd, "E %0d %0d %0d\n", cyc - 64'd1, stall_cnt, err);
        open_b <= 1'b0; stall_cnt <= '0;
      end
    end
  end

  final if (fd != 0) $fclose(fd);
endmodule
