// Program loader: takes a .fcb file as a stream of 4-byte beats (byte 4i+j in bits [8j+7:8j] of beat i), checks it
// the way encode.decode does and writes its instructions to the program memory. Verdict codes: fcar_pkg REFUSE_*,
// reported in decode's order (SHORT, MAGIC, VERSION, CRC, HEADER, SLOTS, SIZE, HASH, INSTRUCTION); the JSON
// metadata is skipped (its bytes are CRC-checked): the host parses it. IMEM_DEPTH instructions fit.
module fcar_loader
  import fcar_pkg::*;
#(
  parameter int ADDR_W = 20
) (
  input  logic                  clk,
  input  logic                  rst,
  input  logic                  go,          // start a file of `len` bytes
  input  logic [31:0]           len,
  input  logic                  in_valid,
  input  logic [31:0]           in_data,
  output logic                  busy,
  output logic                  done,        // one cycle: verdict valid
  output logic [3:0]            refusal,
  output logic [2:0]            fault,
  output logic [31:0]           fault_index, // instruction index in stream order (bundle * SLOTS + slot)
  output logic [31:0]           n_bundles,
  output logic                  imem_we,
  output logic [ADDR_W-1:0]     imem_waddr,
  output logic [INSTR_BITS-1:0] imem_wdata
);
  localparam logic [63:0] IMEM_DEPTH = 64'd1 << ADDR_W;

  function automatic logic [31:0] crc32_byte(input logic [31:0] c, input logic [7:0] b);
    logic [31:0] x;
    x = c ^ {24'd0, b};
    for (int j = 0; j < 8; j++) x = x[0] ? ((x >> 1) ^ CRC32_POLY) : (x >> 1);
    crc32_byte = x;
  endfunction

  logic [31:0]  flen, pos, crc, crc_file;
  logic [255:0] hdr;
  logic [INSTR_BITS-1:0] wbuf;
  logic [5:0]   wcnt;
  logic [63:0]  words;
  logic [16:0]  slot;
  logic         seen_fault, finishing;
  logic [2:0]   first_fault;
  logic [31:0]  first_index;

  // header fields
  logic [31:0] h_magic, h_bundles, h_meta;
  logic [15:0] h_version, h_header_bytes, h_cores, h_slots, h_instr_bytes, h_reserved;
  logic [63:0] h_hash;
  assign h_magic        = hdr[H_MAGIC_LSB +: 32];
  assign h_version      = hdr[H_VERSION_LSB +: 16];
  assign h_header_bytes = hdr[H_HEADER_BYTES_LSB +: 16];
  assign h_hash         = hdr[H_HW_HASH_LSB +: 64];
  assign h_cores        = hdr[H_CORES_LSB +: 16];
  assign h_slots        = hdr[H_SLOTS_LSB +: 16];
  assign h_instr_bytes  = hdr[H_INSTR_BYTES_LSB +: 16];
  assign h_reserved     = hdr[H_RESERVED_LSB +: 16];
  assign h_bundles      = hdr[H_BUNDLES_LSB +: 32];
  assign h_meta         = hdr[H_META_BYTES_LSB +: 32];

  logic [63:0] istart, iend, expected;
  assign istart   = 64'(HEADER_BYTES) + 64'(h_meta);
  assign iend     = istart + 64'(h_bundles) * 64'(h_slots) * 64'(INSTR_BYTES);
  assign expected = iend + 64'(CRC_BYTES);

  // one beat: up to four bytes, each through the CRC and shifted into the header, the instruction being
  // assembled or the CRC field (byte 0 of each ends in bits [7:0])
  logic [31:0]  crc_n, crc_file_n;
  logic [255:0] hdr_n;
  logic [INSTR_BITS-1:0] wbuf_n, word_out;
  logic [5:0]   wcnt_n;
  logic         word_done;
  logic [2:0]   word_fault;
  logic [32:0]  idx;
  logic [7:0]   b;

  fcar_decode u_dec (.instr(word_out), .is_ctl({1'b0, h_slots} != 17'd0 && slot == {1'b0, h_slots} - 17'd1),
                     .fault(word_fault));

  always_comb begin
    crc_n = crc; crc_file_n = crc_file; hdr_n = hdr; wbuf_n = wbuf; wcnt_n = wcnt;
    word_done = 1'b0; word_out = wbuf;
    for (int i = 0; i < 4; i++) begin
      idx = {1'b0, pos} + 33'(i);
      b = in_data[8*i +: 8];
      if (in_valid && busy && !finishing && idx < {1'b0, flen}) begin
        if (idx + 33'(CRC_BYTES) < {1'b0, flen}) crc_n = crc32_byte(crc_n, b);
        else crc_file_n = {b, crc_file_n[31:8]};
        if (idx < 33'(HEADER_BYTES)) hdr_n = {b, hdr_n[255:8]};
        else if (64'(idx) >= istart && 64'(idx) < iend) begin
          wbuf_n = {b, wbuf_n[INSTR_BITS-1:8]};
          if (wcnt_n == 6'd31) begin
            word_done = 1'b1;
            word_out = wbuf_n;
            wcnt_n = 6'd0;
          end else wcnt_n = wcnt_n + 6'd1;
        end
      end
    end
  end

  logic [3:0] verdict;
  always_comb begin
    if (flen < 32'(HEADER_BYTES + CRC_BYTES))                                   verdict = REFUSE_SHORT;
    else if (h_magic != MAGIC)                                                   verdict = REFUSE_MAGIC;
    else if (h_version != 16'(VERSION))                                          verdict = REFUSE_VERSION;
    else if (~crc != crc_file)                                                   verdict = REFUSE_CRC;
    else if (h_header_bytes != 16'(HEADER_BYTES) || h_instr_bytes != 16'(INSTR_BYTES) || h_reserved != 16'd0)
                                                                                 verdict = REFUSE_HEADER;
    else if ({1'b0, h_slots} != {1'b0, h_cores} + 17'd1 || h_cores < 16'd1 || h_cores > 16'(MAX_ROWS))
                                                                                 verdict = REFUSE_SLOTS;
    else if (expected != 64'(flen))                                              verdict = REFUSE_SIZE;
    else if (h_hash != STRUCT_HASH || h_cores != 16'(CORES))                     verdict = REFUSE_HASH;
    else if (seen_fault)                                                         verdict = REFUSE_INSTRUCTION;
    else if (words > IMEM_DEPTH)                                                 verdict = REFUSE_TOO_BIG;
    else                                                                         verdict = REFUSE_NONE;
  end

  always_ff @(posedge clk) begin
    done <= 1'b0;
    imem_we <= 1'b0;
    if (rst) begin
      busy <= 1'b0; finishing <= 1'b0; refusal <= REFUSE_NONE; fault <= FAULT_NONE; fault_index <= '0;
      n_bundles <= '0;
    end else if (go) begin
      busy <= 1'b1; finishing <= (len == 32'd0); flen <= len; pos <= '0; crc <= 32'hFFFF_FFFF; crc_file <= '0;
      hdr <= '0; wbuf <= '0; wcnt <= '0; words <= '0; slot <= '0; seen_fault <= 1'b0; first_fault <= FAULT_NONE;
      first_index <= '0; n_bundles <= '0;
    end else if (busy && finishing) begin
      busy <= 1'b0; finishing <= 1'b0; done <= 1'b1;
      refusal <= verdict;
      fault <= verdict == REFUSE_INSTRUCTION ? first_fault : FAULT_NONE;
      fault_index <= verdict == REFUSE_INSTRUCTION ? first_index : 32'd0;
      n_bundles <= verdict == REFUSE_NONE ? h_bundles : 32'd0;
    end else if (busy && in_valid) begin
      crc <= crc_n; crc_file <= crc_file_n; hdr <= hdr_n; wbuf <= wbuf_n; wcnt <= wcnt_n;
      pos <= pos + 32'd4;
      if (64'(pos) + 64'd4 >= 64'(flen)) finishing <= 1'b1;
      if (word_done) begin
        if (words < IMEM_DEPTH) begin
          imem_we <= 1'b1;
          imem_waddr <= words[ADDR_W-1:0];
          imem_wdata <= word_out;
        end
        if (word_fault != FAULT_NONE && !seen_fault) begin
          seen_fault <= 1'b1; first_fault <= word_fault; first_index <= words[31:0];
        end
        words <= words + 64'd1;
        slot <= ({1'b0, h_slots} != 17'd0 && slot == {1'b0, h_slots} - 17'd1) ? 17'd0 : slot + 17'd1;
      end
    end
  end
endmodule
