/*
 * Graph nodes, user objects and the graph queries of the fake libcuda.so.1 beyond memory nodes
 * (fake_cuda.c): nodes are recorded with their type (a kernel node adds its function's duration to
 * every launch of the graph), listed by cuGraphGetNodes, cloned with the graph. Memcpy and memset
 * nodes are recorded but not replayed (what stream capture records is run when submitted).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fake_cuda.h"

struct CUgraphNode_st *fake_graph_node(struct CUgraph_st *g, CUgraphNodeType type)
{
    if (g->nnodes == g->cap) {
        size_t cap = g->cap ? g->cap * 2 : 8;
        struct CUgraphNode_st **n = realloc(g->nodes, cap * sizeof(*n));
        if (!n) return NULL;
        g->nodes = n;
        g->cap = cap;
    }
    struct CUgraphNode_st *node = calloc(1, sizeof(*node));
    if (!node) return NULL;
    node->type = type;
    node->graph = g;
    g->nodes[g->nnodes++] = node;
    return node;
}

void fake_graph_free(struct CUgraph_st *g)
{
    if (!g) return;
    for (size_t i = 0; i < g->nnodes; i++) free(g->nodes[i]);
    free(g->nodes);
    free(g);
}

static CUresult add_node(CUgraphNode *node, CUgraph g, CUgraphNodeType type)
{
    CHECK_INIT();
    if (!node || !g) return CUDA_ERROR_INVALID_VALUE;
    *node = fake_graph_node(g, type);
    return *node ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

FAKE_EXPORT CUresult cuGraphAddEmptyNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps)
{
    (void)deps;
    (void)ndeps;
    return add_node(node, g, CU_GRAPH_NODE_TYPE_EMPTY);
}

FAKE_EXPORT CUresult cuGraphAddKernelNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                          const CUDA_KERNEL_NODE_PARAMS_v1 *p)
{
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    CUDA_KERNEL_NODE_PARAMS v2;
    memset(&v2, 0, sizeof(v2));
    v2.func = p->func;
    v2.gridDimX = p->gridDimX;
    v2.gridDimY = p->gridDimY;
    v2.gridDimZ = p->gridDimZ;
    v2.blockDimX = p->blockDimX;
    v2.blockDimY = p->blockDimY;
    v2.blockDimZ = p->blockDimZ;
    v2.sharedMemBytes = p->sharedMemBytes;
    v2.kernelParams = p->kernelParams;
    v2.extra = p->extra;
    return cuGraphAddKernelNode_v2(node, g, deps, ndeps, &v2);
}

FAKE_EXPORT CUresult cuGraphAddHostNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                        const CUDA_HOST_NODE_PARAMS *p)
{
    (void)deps;
    (void)ndeps;
    if (!p || !p->fn) return CUDA_ERROR_INVALID_VALUE;
    return add_node(node, g, CU_GRAPH_NODE_TYPE_HOST);
}

FAKE_EXPORT CUresult cuGraphAddEventRecordNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                               CUevent e)
{
    (void)deps;
    (void)ndeps;
    if (!e) return CUDA_ERROR_INVALID_VALUE;
    return add_node(node, g, CU_GRAPH_NODE_TYPE_EVENT_RECORD);
}

FAKE_EXPORT CUresult cuGraphAddEventWaitNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                             CUevent e)
{
    (void)deps;
    (void)ndeps;
    if (!e) return CUDA_ERROR_INVALID_VALUE;
    return add_node(node, g, CU_GRAPH_NODE_TYPE_WAIT_EVENT);
}

FAKE_EXPORT CUresult cuGraphNodeGetType(CUgraphNode node, CUgraphNodeType *type)
{
    CHECK_INIT();
    if (!node || !type) return CUDA_ERROR_INVALID_VALUE;
    *type = node->type;
    return CUDA_SUCCESS;
}

/* Nodes are kept without edges: every node is a root, as if each were added without dependencies. */
static CUresult list_nodes(CUgraph g, CUgraphNode *nodes, size_t *n)
{
    CHECK_INIT();
    if (!g || !n) return CUDA_ERROR_INVALID_VALUE;
    if (nodes) {
        size_t k = *n < g->nnodes ? *n : g->nnodes;
        for (size_t i = 0; i < k; i++) nodes[i] = g->nodes[i];
        for (size_t i = k; i < *n; i++) nodes[i] = NULL;
        *n = k;
    } else {
        *n = g->nnodes;
    }
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuGraphGetNodes(CUgraph g, CUgraphNode *nodes, size_t *n)
{
    return list_nodes(g, nodes, n);
}

FAKE_EXPORT CUresult cuGraphGetRootNodes(CUgraph g, CUgraphNode *nodes, size_t *n)
{
    return list_nodes(g, nodes, n);
}

FAKE_EXPORT CUresult cuGraphClone(CUgraph *clone, CUgraph g)
{
    CHECK_INIT();
    if (!clone || !g) return CUDA_ERROR_INVALID_VALUE;
    struct CUgraph_st *c = calloc(1, sizeof(*c));
    if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
    c->duration_ns = g->duration_ns;
    c->mem_bytes = g->mem_bytes;
    for (size_t i = 0; i < g->nnodes; i++) {
        struct CUgraphNode_st *n = fake_graph_node(c, g->nodes[i]->type);
        if (!n) {
            fake_graph_free(c);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        n->duration_ns = g->nodes[i]->duration_ns;
        n->mem_bytes = g->nodes[i]->mem_bytes;
    }
    *clone = c;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuGraphExecUpdate_v2(CUgraphExec e, CUgraph g, CUgraphExecUpdateResultInfo *info)
{
    CHECK_INIT();
    if (!e || !g) return CUDA_ERROR_INVALID_VALUE;
    if (g->mem_bytes != e->mem_bytes) { /* memory nodes cannot change in an update */
        if (info) info->result = CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED;
        return CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE;
    }
    e->duration_ns = g->duration_ns;
    if (info) {
        info->result = CU_GRAPH_EXEC_UPDATE_SUCCESS;
        info->errorNode = NULL;
        info->errorFromNode = NULL;
    }
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuGraphExecGetFlags(CUgraphExec e, cuuint64_t *flags)
{
    CHECK_INIT();
    if (!e || !flags) return CUDA_ERROR_INVALID_VALUE;
    *flags = 0;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuGraphDebugDotPrint(CUgraph g, const char *path, unsigned int flags)
{
    (void)flags;
    CHECK_INIT();
    if (!g || !path) return CUDA_ERROR_INVALID_VALUE;
    FILE *f = fopen(path, "w");
    if (!f) return CUDA_ERROR_OPERATING_SYSTEM;
    fprintf(f, "digraph cuda_graph {\n");
    for (size_t i = 0; i < g->nnodes; i++) fprintf(f, "  n%zu [label=\"type %d\"];\n", i, (int)g->nodes[i]->type);
    fprintf(f, "}\n");
    fclose(f);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuStreamUpdateCaptureDependencies(CUstream s, CUgraphNode *deps, size_t n, unsigned int flags)
{
    (void)deps;
    (void)n;
    (void)flags;
    CHECK_INIT();
    if (!s || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD || !s->capturing) return CUDA_ERROR_ILLEGAL_STATE;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuStreamUpdateCaptureDependencies_ptsz(CUstream s, CUgraphNode *deps, size_t n,
                                                            unsigned int flags)
{
    return cuStreamUpdateCaptureDependencies(s, deps, n, flags);
}

/* ---------------------------------------------------------------- user objects */

struct CUuserObject_st {
    _Atomic unsigned refs;
    void *ptr;
    CUhostFn destroy;
};

FAKE_EXPORT CUresult cuUserObjectCreate(CUuserObject *obj, void *ptr, CUhostFn destroy, unsigned int count,
                                        unsigned int flags)
{
    CHECK_INIT();
    if (!obj || !destroy || count == 0 || flags != CU_USER_OBJECT_NO_DESTRUCTOR_SYNC) return CUDA_ERROR_INVALID_VALUE;
    struct CUuserObject_st *o = calloc(1, sizeof(*o));
    if (!o) return CUDA_ERROR_OUT_OF_MEMORY;
    atomic_store(&o->refs, count);
    o->ptr = ptr;
    o->destroy = destroy;
    *obj = o;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuUserObjectRetain(CUuserObject obj, unsigned int count)
{
    CHECK_INIT();
    if (!obj || count == 0) return CUDA_ERROR_INVALID_VALUE;
    atomic_fetch_add(&obj->refs, count);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuUserObjectRelease(CUuserObject obj, unsigned int count)
{
    CHECK_INIT();
    if (!obj || count == 0) return CUDA_ERROR_INVALID_VALUE;
    if (atomic_fetch_sub(&obj->refs, count) == count) {
        obj->destroy(obj->ptr);
        free(obj);
    }
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuGraphRetainUserObject(CUgraph g, CUuserObject obj, unsigned int count, unsigned int flags)
{
    (void)flags;
    if (!g) return CUDA_ERROR_INVALID_VALUE;
    return cuUserObjectRetain(obj, count);
}

/* The graph's references go when the graph goes in the driver; here they are released at once when
 * the application releases them, which is the same for every graph that does not outlive them. */
FAKE_EXPORT CUresult cuGraphReleaseUserObject(CUgraph g, CUuserObject obj, unsigned int count)
{
    if (!g) return CUDA_ERROR_INVALID_VALUE;
    return cuUserObjectRelease(obj, count);
}

/* ---------------------------------------------------------------- IPC events and pool access */

FAKE_EXPORT CUresult cuIpcGetEventHandle(CUipcEventHandle *handle, CUevent e)
{
    CHECK_INIT();
    if (!handle || !e) return CUDA_ERROR_INVALID_HANDLE;
    memset(handle, 0, sizeof(*handle));
    memcpy(handle->reserved, "GSEVT001", 8);
    memcpy(handle->reserved + 8, &e->dev, sizeof(e->dev));
    return CUDA_SUCCESS;
}

/* An event opened from another process: on the device's shared timeline, recorded "now". */
FAKE_EXPORT CUresult cuIpcOpenEventHandle(CUevent *e, CUipcEventHandle handle)
{
    CHECK_INIT();
    if (!e || memcmp(handle.reserved, "GSEVT001", 8) != 0) return CUDA_ERROR_INVALID_VALUE;
    struct CUevent_st *ev = calloc(1, sizeof(*ev));
    if (!ev) return CUDA_ERROR_OUT_OF_MEMORY;
    memcpy(&ev->dev, handle.reserved + 8, sizeof(ev->dev));
    if (!valid_dev(ev->dev)) {
        free(ev);
        return CUDA_ERROR_INVALID_VALUE;
    }
    ev->t_ns = fake_now_ns();
    *e = ev;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemPoolSetAccess(CUmemoryPool pool, const CUmemAccessDesc *map, size_t count)
{
    CHECK_INIT();
    if (!pool || (count && !map)) return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemPoolGetAccess(CUmemAccess_flags *flags, CUmemoryPool pool, CUmemLocation *loc)
{
    CHECK_INIT();
    if (!flags || !pool || !loc) return CUDA_ERROR_INVALID_VALUE;
    *flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- copy and memset nodes */

static void set_op(struct CUgraphNode_st *n, void *dst, const void *src, size_t width, size_t height,
                   size_t dst_pitch, size_t src_pitch, const void *value, size_t elem)
{
    n->dst = dst;
    n->src = src;
    n->width = width;
    n->height = height ? height : 1;
    n->dst_pitch = dst_pitch;
    n->src_pitch = src_pitch;
    n->elem = elem;
    if (value && elem <= sizeof(n->value)) memcpy(n->value, value, elem);
}

int fake_capture_op(CUstream s, CUgraphNodeType type, void *dst, const void *src, size_t width, size_t height,
                    size_t dst_pitch, size_t src_pitch, const void *value, size_t elem)
{
    if (!s || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD || !s->capturing) return 0;
    struct CUgraphNode_st *n = fake_graph_node(s->capture_graph, type);
    if (n) set_op(n, dst, src, width, height, dst_pitch, src_pitch, value, elem);
    return 1;
}

void fake_graph_op_run(const struct CUgraphNode_st *op)
{
    for (size_t y = 0; y < op->height; y++) {
        char *row = op->dst + y * op->dst_pitch;
        if (op->type == CU_GRAPH_NODE_TYPE_MEMCPY) memmove(row, op->src + y * op->src_pitch, op->width);
        else if (op->elem == 1) memset(row, op->value[0], op->width);
        else
            for (size_t i = 0; i < op->width; i++) memcpy(row + i * op->elem, op->value, op->elem);
    }
}

CUresult fake_graph_exec_take_ops(struct CUgraphExec_st *x, const struct CUgraph_st *g)
{
    size_t n = 0;
    for (size_t i = 0; i < g->nnodes; i++)
        n += g->nodes[i]->type == CU_GRAPH_NODE_TYPE_MEMCPY || g->nodes[i]->type == CU_GRAPH_NODE_TYPE_MEMSET;
    x->ops = n ? calloc(n, sizeof(*x->ops)) : NULL;
    if (n && !x->ops) return CUDA_ERROR_OUT_OF_MEMORY;
    for (size_t i = 0; i < g->nnodes; i++)
        if (g->nodes[i]->type == CU_GRAPH_NODE_TYPE_MEMCPY || g->nodes[i]->type == CU_GRAPH_NODE_TYPE_MEMSET)
            x->ops[x->nops++] = *g->nodes[i];
    return CUDA_SUCCESS;
}

static char *memcpy3d_ptr(CUmemorytype t, const void *host, CUdeviceptr dev)
{
    return t == CU_MEMORYTYPE_HOST ? (char *)host : (char *)(uintptr_t)dev;
}

FAKE_EXPORT CUresult cuGraphAddMemcpyNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                          const CUDA_MEMCPY3D *p, CUcontext ctx)
{
    (void)deps;
    (void)ndeps;
    (void)ctx;
    CHECK_INIT();
    if (!node || !g || !p) return CUDA_ERROR_INVALID_VALUE;
    if (p->srcMemoryType == CU_MEMORYTYPE_ARRAY || p->dstMemoryType == CU_MEMORYTYPE_ARRAY || p->Depth > 1)
        return CUDA_ERROR_NOT_SUPPORTED; /* arrays and 3D copies are not modeled */
    char *dst = memcpy3d_ptr(p->dstMemoryType, p->dstHost, p->dstDevice);
    const char *src = memcpy3d_ptr(p->srcMemoryType, p->srcHost, p->srcDevice);
    if (!dst || !src) return CUDA_ERROR_INVALID_VALUE;
    *node = fake_graph_node(g, CU_GRAPH_NODE_TYPE_MEMCPY);
    if (!*node) return CUDA_ERROR_OUT_OF_MEMORY;
    set_op(*node, dst + p->dstY * p->dstPitch + p->dstXInBytes, src + p->srcY * p->srcPitch + p->srcXInBytes,
           p->WidthInBytes, p->Height, p->dstPitch, p->srcPitch, NULL, 1);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuGraphAddMemsetNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                          const CUDA_MEMSET_NODE_PARAMS *p, CUcontext ctx)
{
    (void)deps;
    (void)ndeps;
    (void)ctx;
    CHECK_INIT();
    if (!node || !g || !p || !p->dst || (p->elementSize != 1 && p->elementSize != 2 && p->elementSize != 4))
        return CUDA_ERROR_INVALID_VALUE;
    *node = fake_graph_node(g, CU_GRAPH_NODE_TYPE_MEMSET);
    if (!*node) return CUDA_ERROR_OUT_OF_MEMORY;
    set_op(*node, (char *)(uintptr_t)p->dst, NULL, p->width, p->height, p->pitch, 0, &p->value, p->elementSize);
    return CUDA_SUCCESS;
}
