/* Module and library loading in the fake libcuda.so.1 (cuda_module.c), used by the export tables too. */
#ifndef FAKE_MODULE_H
#define FAKE_MODULE_H

#include <cuda.h>

enum { FAKE_LOAD_DRIVER = 0, FAKE_LOAD_RUNTIME = 1 };

/* Loads a fatbin, fatbin wrapper, cubin or PTX image for the current context's device, choosing the
 * image the device runs as the driver does; the driver's error when none does. */
CUresult fake_module_load(CUmodule *module, const void *image, int how);

/* Runs the context-local-storage destructors of a context that is going away (cuda_export.c). */
void fake_cls_context_gone(CUcontext ctx);

#endif
