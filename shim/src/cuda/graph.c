/*
 * Graph memory nodes: charged when an executable graph first gets its memory, until trimmed.
 */
#define _GNU_SOURCE
#include "../gs_cuda.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

/* ------------------------------------------------------------------------------------------------
 * Graph memory nodes. The driver gives an executable graph's alloc nodes physical memory at its first
 * launch and keeps it across launches; destroying the executable returns it to the device's graph
 * pool, which keeps it reserved until cuDeviceGraphMemTrim. So: a graph remembers its alloc nodes'
 * bytes, an instantiation inherits them, the first launch charges them (taking from the pool's spare
 * first), destroying the executable moves them to the spare, and a trim credits the spare.
 * ---------------------------------------------------------------------------------------------- */

#define GS_GEXEC_BACKED (1ull << 63)
_Atomic int has_graph_mem; /* some graph has alloc nodes: launches look their executable up */
static _Atomic uint64_t graph_spare;
static pthread_mutex_t graph_lock = PTHREAD_MUTEX_INITIALIZER;

/* A graph gained an alloc node of `bytes` (rc: the driver's answer). */
static CUresult graph_gained(CUresult rc, CUgraph g, uint64_t bytes)
{
    if (rc != CUDA_SUCCESS || bytes == 0 || gs_ensure_init() != GS_MODE_ACTIVE) return rc;
    pthread_mutex_lock(&graph_lock);
    uint64_t v = 0;
    (void)gs_table_take(&tab_graph, (uint64_t)(uintptr_t)g, &v);
    if (remember(&tab_graph, (uint64_t)(uintptr_t)g, v + bytes) != 0) rc = CUDA_ERROR_OUT_OF_MEMORY;
    atomic_store(&has_graph_mem, 1);
    pthread_mutex_unlock(&graph_lock);
    return rc;
}

GS_EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                          size_t numDependencies, CUDA_MEM_ALLOC_NODE_PARAMS *nodeParams)
{
    NEED_REAL(cuGraphAddMemAllocNode);
    CUresult rc = real_cuGraphAddMemAllocNode(phGraphNode, hGraph, dependencies, numDependencies, nodeParams);
    return graph_gained(rc, hGraph, nodeParams ? nodeParams->bytesize : 0);
}

/* The generic node API (CUDA 12.2+) adds alloc nodes too, and moves a child graph, with the alloc
 * nodes it has, into its parent (only a moved child may have them): the child's bytes go with it. */
static uint64_t alloc_node_bytes(CUresult rc, const CUgraphNodeParams *p)
{
    if (rc != CUDA_SUCCESS || p == NULL) return 0;
    if (p->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC) return p->alloc.bytesize;
    if (p->type != CU_GRAPH_NODE_TYPE_GRAPH || p->graph.ownership != CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE ||
        !atomic_load(&has_graph_mem))
        return 0;
    uint64_t v = 0;
    pthread_mutex_lock(&graph_lock);
    (void)gs_table_take(&tab_graph, (uint64_t)(uintptr_t)p->graph.graph, &v);
    pthread_mutex_unlock(&graph_lock);
    return v;
}

GS_EXPORT CUresult cuGraphAddNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                  size_t numDependencies, CUgraphNodeParams *nodeParams)
{
    NEED_REAL(cuGraphAddNode);
    CUresult rc = real_cuGraphAddNode(phGraphNode, hGraph, dependencies, numDependencies, nodeParams);
    return graph_gained(rc, hGraph, alloc_node_bytes(rc, nodeParams));
}

GS_EXPORT CUresult cuGraphAddNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                     const CUgraphEdgeData *dependencyData, size_t numDependencies,
                                     CUgraphNodeParams *nodeParams)
{
    NEED_REAL(cuGraphAddNode_v2);
    CUresult rc = real_cuGraphAddNode_v2(phGraphNode, hGraph, dependencies, dependencyData, numDependencies, nodeParams);
    return graph_gained(rc, hGraph, alloc_node_bytes(rc, nodeParams));
}

/* A clone carries its original's alloc nodes. */
GS_EXPORT CUresult cuGraphClone(CUgraph *phGraphClone, CUgraph originalGraph)
{
    NEED_REAL(cuGraphClone);
    CUresult rc = real_cuGraphClone(phGraphClone, originalGraph);
    uint64_t v = 0;
    if (rc != CUDA_SUCCESS || phGraphClone == NULL || !atomic_load(&has_graph_mem)) return rc;
    pthread_mutex_lock(&graph_lock);
    int has = gs_table_get(&tab_graph, (uint64_t)(uintptr_t)originalGraph, &v) == 0 && v != 0;
    pthread_mutex_unlock(&graph_lock);
    return has ? graph_gained(rc, *phGraphClone, v) : rc;
}

static void graph_instantiated(CUresult rc, CUgraphExec *exec, CUgraph g)
{
    uint64_t v;
    if (rc != CUDA_SUCCESS || exec == NULL || !atomic_load(&has_graph_mem) || atomic_load(&gs_mode) != GS_MODE_ACTIVE)
        return;
    pthread_mutex_lock(&graph_lock);
    if (gs_table_get(&tab_graph, (uint64_t)(uintptr_t)g, &v) == 0 && v != 0)
        (void)remember(&tab_gexec, (uint64_t)(uintptr_t)*exec, v);
    pthread_mutex_unlock(&graph_lock);
}

GS_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags)
{
    NEED_REAL(cuGraphInstantiateWithFlags);
    CUresult rc = real_cuGraphInstantiateWithFlags(phGraphExec, hGraph, flags);
    graph_instantiated(rc, phGraphExec, hGraph);
    return rc;
}

GS_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
    NEED_REAL(cuGraphInstantiateWithParams);
    CUresult rc = real_cuGraphInstantiateWithParams(phGraphExec, hGraph, instantiateParams);
    graph_instantiated(rc, phGraphExec, hGraph);
    return rc;
}

GS_EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                     CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
    NEED_REAL(cuGraphInstantiateWithParams_ptsz);
    CUresult rc = real_cuGraphInstantiateWithParams_ptsz(phGraphExec, hGraph, instantiateParams);
    graph_instantiated(rc, phGraphExec, hGraph);
    return rc;
}

/* cuGraphInstantiate as CUDA 10.0 and 11.x callers get it (error node and log buffer). */
GS_EXPORT CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                      char *logBuffer, size_t bufferSize)
{
    NEED_REAL(cuGraphInstantiate);
    CUresult rc = real_cuGraphInstantiate(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize);
    graph_instantiated(rc, phGraphExec, hGraph);
    return rc;
}

GS_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                         char *logBuffer, size_t bufferSize)
{
    NEED_REAL(cuGraphInstantiate_v2);
    CUresult rc = real_cuGraphInstantiate_v2(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize);
    graph_instantiated(rc, phGraphExec, hGraph);
    return rc;
}

GS_EXPORT CUresult cuGraphDestroy(CUgraph hGraph)
{
    NEED_REAL(cuGraphDestroy);
    CUresult rc = real_cuGraphDestroy(hGraph);
    uint64_t v;
    if (rc == CUDA_SUCCESS && atomic_load(&has_graph_mem) && atomic_load(&gs_mode) == GS_MODE_ACTIVE) {
        pthread_mutex_lock(&graph_lock);
        (void)gs_table_take(&tab_graph, (uint64_t)(uintptr_t)hGraph, &v);
        pthread_mutex_unlock(&graph_lock);
    }
    return rc;
}

GS_EXPORT CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    NEED_REAL(cuGraphExecDestroy);
    CUresult rc = real_cuGraphExecDestroy(hGraphExec);
    uint64_t v;
    if (rc == CUDA_SUCCESS && atomic_load(&has_graph_mem) && atomic_load(&gs_mode) == GS_MODE_ACTIVE) {
        pthread_mutex_lock(&graph_lock);
        if (gs_table_take(&tab_gexec, (uint64_t)(uintptr_t)hGraphExec, &v) == 0 && (v & GS_GEXEC_BACKED))
            atomic_fetch_add(&graph_spare, v & ~GS_GEXEC_BACKED); /* kept by the device's graph pool */
        pthread_mutex_unlock(&graph_lock);
    }
    return rc;
}

GS_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice device)
{
    NEED_REAL(cuDeviceGraphMemTrim);
    CUresult rc = real_cuDeviceGraphMemTrim(device);
    if (rc == CUDA_SUCCESS && atomic_load(&gs_mode) == GS_MODE_ACTIVE && device_is_slice(device)) {
        pthread_mutex_lock(&graph_lock);
        release(atomic_exchange(&graph_spare, 0));
        pthread_mutex_unlock(&graph_lock);
    }
    return rc;
}

/* Launching an executable whose memory is not backed yet: reserve -> launch -> mark backed / undo. */
CUresult graph_launch(CUresult (*fn)(CUgraphExec, CUstream), CUgraphExec g, CUstream s)
{
    uint64_t v, key = (uint64_t)(uintptr_t)g;
    pthread_mutex_lock(&graph_lock);
    if (gs_table_get(&tab_gexec, key, &v) != 0 || (v & GS_GEXEC_BACKED)) {
        pthread_mutex_unlock(&graph_lock);
        return fn(g, s);
    }
    uint64_t spare = atomic_load(&graph_spare), from_spare = spare < v ? spare : v;
    if (from_spare < v && reserve_current(v - from_spare) != CUDA_SUCCESS) {
        pthread_mutex_unlock(&graph_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    atomic_fetch_sub(&graph_spare, from_spare);
    CUresult rc = fn(g, s);
    if (rc == CUDA_SUCCESS) {
        (void)gs_table_take(&tab_gexec, key, &v);
        (void)gs_table_put(&tab_gexec, key, v | GS_GEXEC_BACKED);
    } else {
        atomic_fetch_add(&graph_spare, from_spare);
        if (from_spare < v) release(v - from_spare);
    }
    pthread_mutex_unlock(&graph_lock);
    return rc;
}

/* A forked child holds none of its parent's graphs. */
void gs_graph_after_fork_child(void)
{
    gs_table_clear(&tab_graph);
    gs_table_clear(&tab_gexec);
    atomic_store(&graph_spare, 0);
    pthread_mutex_init(&graph_lock, NULL);
}

