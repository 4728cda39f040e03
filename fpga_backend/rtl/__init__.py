"""RTL of the DRS dispatcher (SystemVerilog under ``sv/``), its generated package, the Verilator + cocotb
co-simulation against the Python simulator, and yosys synthesis. See docs/fpga.md, section "RTL"."""
