// Instruction decoder check: the first failing check of one 256-bit instruction (fcar_pkg FAULT_*), in the
// order isa.instruction_faults checks them. Combinational; is_ctl says the word sits in a bundle's control slot.
module fcar_decode
  import fcar_pkg::*;
(
  input  logic [INSTR_BITS-1:0] instr,
  input  logic                  is_ctl,
  output logic [2:0]            fault
);
  logic [7:0] op, flags, sub, rsv;
  assign op    = instr[F_OPCODE_LSB +: 8];
  assign flags = instr[F_FLAGS_LSB +: 8];
  assign sub   = instr[F_SUB_LSB +: 8];
  assign rsv   = instr[F_RESERVED_LSB +: 8];

  always_comb begin
    if (!known_op(op))                      fault = FAULT_OPCODE;
    else if (!is_ctl && !core_op(op))       fault = FAULT_CONTROL_IN_CORE;
    else if (is_ctl && !control_op(op))     fault = FAULT_CORE_IN_CONTROL;
    else if ((flags & ~FLAG_MASK) != 8'd0)  fault = FAULT_FLAGS;
    else if (rsv != 8'd0)                   fault = FAULT_RESERVED;
    else if (!sub_ok(op, sub))              fault = FAULT_SUB;
    else                                    fault = FAULT_NONE;
  end
endmodule
