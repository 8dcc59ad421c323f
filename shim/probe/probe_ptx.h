/* The kernels the driver-API programs load as PTX (probe/gpuslice_probe.c, tests/cuda_probe.c):
 * loadable by the real driver (PTX JIT, no nvcc) and by the test double, which does not execute
 * them but takes each launch's duration from the first line's comment. The text is a printf format:
 * its one argument is that duration in microseconds. */
#ifndef PROBE_PTX_H
#define PROBE_PTX_H

#define PROBE_PTX_HEAD                                                                                   \
    "// gpuslice-fake: duration_us=%u\n"                                                                 \
    ".version 6.0\n.target sm_70\n.address_size 64\n"

/* `empty`: returns at once. */
#define PROBE_PTX_EMPTY ".visible .entry empty()\n{\n\tret;\n}\n"

/* `spin(cycles)`: busy-waits that many SM clock cycles. */
#define PROBE_PTX_SPIN                                                                                   \
    ".visible .entry spin(.param .u64 spin_param_0)\n{\n"                                                \
    "\t.reg .pred %%p<2>;\n\t.reg .b64 %%rd<6>;\n"                                                       \
    "\tld.param.u64 %%rd1, [spin_param_0];\n"                                                            \
    "\tmov.u64 %%rd2, %%clock64;\n"                                                                      \
    "$L_spin:\n"                                                                                         \
    "\tmov.u64 %%rd3, %%clock64;\n"                                                                      \
    "\tsub.s64 %%rd4, %%rd3, %%rd2;\n"                                                                   \
    "\tsetp.lt.u64 %%p1, %%rd4, %%rd1;\n"                                                                \
    "\t@%%p1 bra $L_spin;\n"                                                                             \
    "\tret;\n}\n"

#endif
