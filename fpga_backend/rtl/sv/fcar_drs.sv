// The DRS unit: program loader (fcar_loader: header, CRC, instruction decoder) and dispatcher (fcar_dispatch:
// fetch, Index Register, TAS comparison, row queues, Mapping Registers, MLP-cache ports, lock-step issue and the
// barrier between bundles). This is the control path synthesised with yosys; the cores and the DRAM stream are
// latency models behind its issue / done interface.
module fcar_drs
  import fcar_pkg::*;
#(
  parameter int ADDR_W = 20
) (
  input  logic                        clk,
  input  logic                        rst,
  // program file in (4-byte beats)
  input  logic                        load_go,
  input  logic [31:0]                 load_len,
  input  logic                        in_valid,
  input  logic [31:0]                 in_data,
  output logic                        load_busy,
  output logic                        load_done,
  output logic [3:0]                  refusal,
  output logic [2:0]                  fault,
  output logic [31:0]                 fault_index,
  output logic                        prog_valid,
  // program memory
  output logic                        imem_we,
  output logic [ADDR_W-1:0]           imem_waddr,
  output logic [INSTR_BITS-1:0]       imem_wdata,
  output logic                        imem_re,
  output logic [ADDR_W-1:0]           imem_raddr,
  input  logic [INSTR_BITS-1:0]       imem_rdata,
  // host registers and steps
  input  logic [MAX_ROWS-1:0]         cfg_active,
  input  logic [CORES*MAX_ROWS-1:0]   cfg_binding,
  input  logic                        cfg_drs,
  input  logic                        cfg_per_core,
  input  logic                        start,
  output logic                        running,
  output logic                        step_done,
  // TAS datapath
  output logic [15:0]                 tas_layer,
  input  logic [MAX_ROWS*32-1:0]      tas_score,
  input  logic [MAX_ROWS-1:0]         tas_valid,
  // cores
  output logic                        issue,
  output logic [31:0]                 issue_pc,
  output logic                        issue_remap,
  output logic [CORES-1:0]            slot_live,
  output logic [CORES*INSTR_BITS-1:0] slot_instr,
  output logic [CORES*MAX_ROWS-1:0]   slot_rows,
  output logic                        remapping,
  output logic                        remap_start,
  output logic                        stalled,
  input  logic [CORES-1:0]            core_done,
  input  logic                        dram_done,
  output logic                        drs_set,
  output logic [15:0]                 drs_layer,
  output logic [MAX_ROWS-1:0]         latched,
  output logic [CORES-1:0]            cache_valid,
  output logic [CORES-1:0]            cache_read,
  output logic [CORES*ROW_BITS-1:0]   cache_row,
  output logic [CORES*64-1:0]         cache_bytes,
  output logic [MAX_ROWS*((CORES > 1) ? $clog2(CORES) : 1)-1:0] mapping,
  output logic [7:0]                  err
);
  logic [31:0] n_bundles, loaded_bundles;
  fcar_loader #(.ADDR_W(ADDR_W)) u_loader (
    .clk, .rst, .go(load_go), .len(load_len), .in_valid, .in_data, .busy(load_busy), .done(load_done),
    .refusal, .fault, .fault_index, .n_bundles(loaded_bundles), .imem_we, .imem_waddr, .imem_wdata);

  always_ff @(posedge clk) begin
    if (rst || load_go) begin
      prog_valid <= 1'b0; n_bundles <= '0;
    end else if (load_done) begin
      prog_valid <= refusal == REFUSE_NONE; n_bundles <= loaded_bundles;
    end
  end

  fcar_dispatch #(.ADDR_W(ADDR_W)) u_dispatch (
    .clk, .rst, .cfg_active, .cfg_binding, .cfg_drs, .cfg_per_core, .prog_reset(load_go), .prog_valid,
    .n_bundles, .start, .running, .step_done, .imem_re, .imem_raddr, .imem_rdata, .tas_layer, .tas_score,
    .tas_valid, .issue, .issue_pc, .issue_remap, .slot_live, .slot_instr, .slot_rows, .remapping, .remap_start, .stalled,
    .core_done, .dram_done, .drs_set, .drs_layer, .latched, .cache_valid, .cache_read, .cache_row, .cache_bytes,
    .mapping, .err);
endmodule
