/* Streams, events, copies and context queries of the fake libcuda.so.1 beyond the core (fake_cuda.c). */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "fake_cuda.h"
