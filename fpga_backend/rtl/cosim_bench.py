"""cocotb testbench of the DRS unit, run inside the Verilator model by `cosim.run_bench` (never imported
otherwise). It plays the host: reset, stream each .fcb image of the job through the loader and read the
verdict, then program the host registers (active rows, binding, policy, weight streams) and run the decode
steps, each one start pulse and a wait for step_done (with a cycle budget). The clock and the monitor live in
tb_top.sv; the job (FCAR_JOB, JSON) says what to run and where the verdicts go."""

from __future__ import annotations

import json
import os
from pathlib import Path

import cocotb
from cocotb.triggers import ReadOnly, RisingEdge, Timer, with_timeout

CLOCK_NS = 2  # fcar_main.cpp: one clock cycle per 2 ns time slot (build.FLAGS: 1 ns time unit)
HOST_CYCLES = 100  # the host programs its registers after a load: the first bundle is fetched meanwhile


async def _cycle(dut) -> None:
    """One clock cycle: fcar_main.cpp runs a whole cycle per time slot (the clock is not visible here)."""
    await Timer(CLOCK_NS, "ns")


async def _pulse(dut, signal) -> None:
    signal.value = 1
    await _cycle(dut)
    signal.value = 0


@cocotb.test()
async def run_job(dut):
    job = json.loads(Path(os.environ["FCAR_JOB"]).read_text())
    out: dict = {"loads": [], "steps": []}
    dut.rst.value = 1
    for _ in range(4):
        await _cycle(dut)
    dut.rst.value = 0
    await _cycle(dut)
    for off, length in job["files"]:
        dut.load_off.value = off
        dut.load_len.value = length
        await _pulse(dut, dut.load_go)
        await with_timeout(RisingEdge(dut.load_done), CLOCK_NS * (length // 4 + 1000), "ns")
        await ReadOnly()
        out["loads"].append([int(dut.refusal.value), int(dut.fault.value), int(dut.fault_index.value)])
        await _cycle(dut)
    if job.get("runs"):
        dut.cfg_active.value = job["active"]
        dut.cfg_binding.value = sum(int(m) << (32 * c) for c, m in enumerate(job["binding"]))
        dut.n_layers.value = job["layers"]
        dut.cfg_wbits.value = job["wbits"]
        for _ in range(HOST_CYCLES):
            await _cycle(dut)
        for tag, run in enumerate(job["runs"]):
            dut.cfg_drs.value = int(run["policy"] == "drs")
            dut.cfg_per_core.value = int(run["stream"] == "per_core")
            dut.log_tag.value = tag
            for step, budget in enumerate(run["budgets"]):
                dut.step_base.value = step * job["layers"]
                await _cycle(dut)
                await _pulse(dut, dut.start)
                await with_timeout(RisingEdge(dut.step_done), CLOCK_NS * budget, "ns")
                await ReadOnly()
                out["steps"].append({"run": tag, "step": step, "err": int(dut.err.value)})
                await _cycle(dut)
    Path(job["result"]).write_text(json.dumps(out))
