// Main loop of the co-simulation model: cocotb's VPI callback regions around each time slot, with tb_top's
// clock driven from here: a slot every CLOCK_PERIOD time units holds one whole clock cycle (rising edge, then
// falling edge; the design is synchronous to the rising edge), so the callbacks run once a cycle and no timed
// HDL process needs Verilator's timing scheduler. cocotb sees a register change in the slot of the edge that
// made it, and its writes reach the next edge. Slots between are cocotb's own timers.
#include <memory>

#include "Vtop.h"
#include "verilated.h"
#include "verilated_vpi.h"

static vluint64_t main_time = 0;
double sc_time_stamp() { return static_cast<double>(main_time); }

extern "C" void vlog_startup_routines_bootstrap(void);

// value-change callbacks may write signals: call them until none fires
static bool settle() {
    const bool called = VerilatedVpi::callValueCbs();
    bool again = called;
    while (again) again = VerilatedVpi::callValueCbs();
    return called;
}

static const vluint64_t CLOCK_PERIOD = 2;

// one time slot: timed callbacks, a clock cycle, evaluation to a fixed point with read-write callbacks, then
// read-only ones
static void time_slot(Vtop* top, bool cycle) {
    VerilatedVpi::callTimedCbs();
    settle();
    if (cycle) {
        top->clk = 1;
        top->eval_step();
        top->clk = 0;
    }
    bool again = true;
    while (again) {
        top->eval_step();
        again = settle();
        again |= VerilatedVpi::callCbs(cbReadWriteSynch);
        again |= settle();
    }
    top->eval_end_step();
    VerilatedVpi::callCbs(cbReadOnlySynch);
}

int main(int argc, char** argv) {
    Verilated::commandArgs(argc, argv);
    const std::unique_ptr<Vtop> top{new Vtop{""}};
    Verilated::fatalOnVpiError(false);
    vlog_startup_routines_bootstrap();
    VerilatedVpi::callCbs(cbStartOfSimulation);
    top->clk = 0;
    time_slot(top.get(), false);
    while (!Verilated::gotFinish()) {
        const vluint64_t edge = (main_time / CLOCK_PERIOD + 1) * CLOCK_PERIOD;
        const vluint64_t deadline = VerilatedVpi::cbNextDeadline();
        main_time = (deadline > main_time && deadline < edge) ? deadline : edge;
        VerilatedVpi::callCbs(cbNextSimTime);
        settle();
        time_slot(top.get(), main_time == edge);
    }
    VerilatedVpi::callCbs(cbEndOfSimulation);
    top->final();
    return 0;
}
