/*
 * Graph nodes, user objects and the graph queries of the fake libcuda.so.1 beyond memory nodes
 * (fake_cuda.c): nodes are recorded with their type and how many dependencies they have (a kernel
 * node adds its function's duration to every launch of the graph; a child graph node its graph's
 * duration, copies and, moved in, its memory nodes), listed by cuGraphGetNodes (roots: no
 * dependencies), cloned with the graph. Copy and memset nodes are replayed at each launch.
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
    for (size_t i = 0; i < g->nnodes; i++) {
        fake_graph_free(g->nodes[i]->child);
        free(g->nodes[i]);
    }
    free(g->nodes);
    free(g);
}

static int in_graph(const struct CUgraph_st *g, const struct CUgraphNode_st *n)
{
    for (size_t i = 0; n && i < g->nnodes; i++)
        if (g->nodes[i] == n) return 1;
    return 0;
}

CUresult fake_graph_deps(struct CUgraph_st *g, struct CUgraphNode_st *node, const CUgraphNode *deps, size_t n)
{
    if (n && !deps) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < n; i++)
        if (!in_graph(g, deps[i]) || deps[i] == node) return CUDA_ERROR_INVALID_VALUE;
    if (node) node->nin += n;
    return CUDA_SUCCESS;
}

struct CUgraph_st *fake_graph_clone(const struct CUgraph_st *g)
{
    struct CUgraph_st *c = calloc(1, sizeof(*c));
    if (!c) return NULL;
    c->duration_ns = g->duration_ns;
    c->mem_bytes = g->mem_bytes;
    for (size_t i = 0; i < g->nnodes; i++) {
        struct CUgraphNode_st *n = fake_graph_node(c, g->nodes[i]->type);
        if (!n) goto oom;
        *n = *g->nodes[i]; /* its type, duration, memory, copy or fill and dependency count */
        n->graph = c;
        n->child = NULL;
        if (g->nodes[i]->child && !(n->child = fake_graph_clone(g->nodes[i]->child))) goto oom;
        if (n->child) n->child->owned = 1;
    }
    return c;
oom:
    fake_graph_free(c);
    return NULL;
}

static CUresult add_node(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps, CUgraphNodeType type)
{
    CHECK_INIT();
    if (!node || !g || fake_graph_deps(g, NULL, deps, ndeps) != CUDA_SUCCESS) return CUDA_ERROR_INVALID_VALUE;
    *node = fake_graph_node(g, type);
    if (!*node) return CUDA_ERROR_OUT_OF_MEMORY;
    (*node)->nin = ndeps;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuGraphAddEmptyNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps)
{
    return add_node(node, g, deps, ndeps, CU_GRAPH_NODE_TYPE_EMPTY);
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
    if (!p || !p->fn) return CUDA_ERROR_INVALID_VALUE;
    return add_node(node, g, deps, ndeps, CU_GRAPH_NODE_TYPE_HOST);
}

FAKE_EXPORT CUresult cuGraphAddEventRecordNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                               CUevent e)
{
    if (!e) return CUDA_ERROR_INVALID_VALUE;
    return add_node(node, g, deps, ndeps, CU_GRAPH_NODE_TYPE_EVENT_RECORD);
}

FAKE_EXPORT CUresult cuGraphAddEventWaitNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                             CUevent e)
{
    if (!e) return CUDA_ERROR_INVALID_VALUE;
    return add_node(node, g, deps, ndeps, CU_GRAPH_NODE_TYPE_WAIT_EVENT);
}

FAKE_EXPORT CUresult cuGraphNodeGetType(CUgraphNode node, CUgraphNodeType *type)
{
    CHECK_INIT();
    if (!node || !type) return CUDA_ERROR_INVALID_VALUE;
    *type = node->type;
    return CUDA_SUCCESS;
}

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
    CHECK_INIT();
    if (!g || !n) return CUDA_ERROR_INVALID_VALUE;
    size_t k = 0;
    for (size_t i = 0; i < g->nnodes; i++) {
        if (g->nodes[i]->nin) continue;
        if (nodes && k < *n) nodes[k] = g->nodes[i];
        k++;
    }
    if (nodes) {
        for (size_t i = k; i < *n; i++) nodes[i] = NULL;
        if (k > *n) k = *n;
    }
    *n = k;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuGraphClone(CUgraph *clone, CUgraph g)
{
    CHECK_INIT();
    if (!clone || !g || g->owned) return CUDA_ERROR_INVALID_VALUE;
    *clone = fake_graph_clone(g);
    return *clone ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
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

static int is_op(const struct CUgraphNode_st *n)
{
    return n->type == CU_GRAPH_NODE_TYPE_MEMCPY || n->type == CU_GRAPH_NODE_TYPE_MEMSET;
}

static size_t count_ops(const struct CUgraph_st *g)
{
    size_t n = 0;
    for (size_t i = 0; i < g->nnodes; i++) n += is_op(g->nodes[i]) + (g->nodes[i]->child ? count_ops(g->nodes[i]->child) : 0);
    return n;
}

static void take_ops(struct CUgraphExec_st *x, const struct CUgraph_st *g)
{
    for (size_t i = 0; i < g->nnodes; i++) {
        if (is_op(g->nodes[i])) x->ops[x->nops++] = *g->nodes[i];
        if (g->nodes[i]->child) take_ops(x, g->nodes[i]->child);
    }
}

CUresult fake_graph_exec_take_ops(struct CUgraphExec_st *x, const struct CUgraph_st *g)
{
    size_t n = count_ops(g), k = 0;
    for (size_t i = 0; i < g->nnodes; i++) k += g->nodes[i]->type == CU_GRAPH_NODE_TYPE_KERNEL;
    x->ops = n ? calloc(n, sizeof(*x->ops)) : NULL;
    x->knodes = k ? calloc(k, sizeof(*x->knodes)) : NULL;
    x->kdur = k ? calloc(k, sizeof(*x->kdur)) : NULL;
    if ((n && !x->ops) || (k && (!x->knodes || !x->kdur))) {
        fake_graph_exec_free_ops(x);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    take_ops(x, g);
    for (size_t i = 0; i < g->nnodes; i++)
        if (g->nodes[i]->type == CU_GRAPH_NODE_TYPE_KERNEL) {
            x->knodes[x->nk] = g->nodes[i];
            x->kdur[x->nk++] = g->nodes[i]->duration_ns;
        }
    return CUDA_SUCCESS;
}

void fake_graph_exec_free_ops(struct CUgraphExec_st *x)
{
    free(x->ops);
    free(x->knodes);
    free(x->kdur);
    x->ops = NULL;
    x->knodes = NULL;
    x->kdur = NULL;
    x->nops = x->nk = 0;
}

static char *memcpy3d_ptr(CUmemorytype t, const void *host, CUdeviceptr dev)
{
    return t == CU_MEMORYTYPE_HOST ? (char *)host : (char *)(uintptr_t)dev;
}

FAKE_EXPORT CUresult cuGraphAddMemcpyNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                          const CUDA_MEMCPY3D *p, CUcontext ctx)
{
    (void)ctx;
    CHECK_INIT();
    if (!node || !g || !p || fake_graph_deps(g, NULL, deps, ndeps) != CUDA_SUCCESS) return CUDA_ERROR_INVALID_VALUE;
    if (p->srcMemoryType == CU_MEMORYTYPE_ARRAY || p->dstMemoryType == CU_MEMORYTYPE_ARRAY || p->Depth > 1)
        return CUDA_ERROR_NOT_SUPPORTED; /* arrays and 3D copies are not modeled */
    char *dst = memcpy3d_ptr(p->dstMemoryType, p->dstHost, p->dstDevice);
    const char *src = memcpy3d_ptr(p->srcMemoryType, p->srcHost, p->srcDevice);
    if (!dst || !src) return CUDA_ERROR_INVALID_VALUE;
    *node = fake_graph_node(g, CU_GRAPH_NODE_TYPE_MEMCPY);
    if (!*node) return CUDA_ERROR_OUT_OF_MEMORY;
    (*node)->nin = ndeps;
    set_op(*node, dst + p->dstY * p->dstPitch + p->dstXInBytes, src + p->srcY * p->srcPitch + p->srcXInBytes,
           p->WidthInBytes, p->Height, p->dstPitch, p->srcPitch, NULL, 1);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuGraphAddMemsetNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                          const CUDA_MEMSET_NODE_PARAMS *p, CUcontext ctx)
{
    (void)ctx;
    CHECK_INIT();
    if (!node || !g || !p || !p->dst || (p->elementSize != 1 && p->elementSize != 2 && p->elementSize != 4) ||
        fake_graph_deps(g, NULL, deps, ndeps) != CUDA_SUCCESS)
        return CUDA_ERROR_INVALID_VALUE;
    *node = fake_graph_node(g, CU_GRAPH_NODE_TYPE_MEMSET);
    if (!*node) return CUDA_ERROR_OUT_OF_MEMORY;
    (*node)->nin = ndeps;
    set_op(*node, (char *)(uintptr_t)p->dst, NULL, p->width, p->height, p->pitch, 0, &p->value, p->elementSize);
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- child graphs, the generic node API */

static CUresult add_child(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps, CUgraph child,
                          CUgraphChildGraphNodeOwnership ownership)
{
    CHECK_INIT();
    if (!node || !g || !child || child == g || child->owned || fake_graph_deps(g, NULL, deps, ndeps))
        return CUDA_ERROR_INVALID_VALUE;
    int move = ownership == CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE;
    if (!move && ownership != CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE) return CUDA_ERROR_INVALID_VALUE;
    /* A graph with memory nodes can only be moved in (cuda.h, CUDA_CHILD_GRAPH_NODE_PARAMS). */
    if (!move && child->mem_bytes) return CUDA_ERROR_NOT_SUPPORTED;
    for (size_t i = 0; !move && i < child->nnodes; i++)
        if (child->nodes[i]->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC || child->nodes[i]->type == CU_GRAPH_NODE_TYPE_MEM_FREE)
            return CUDA_ERROR_NOT_SUPPORTED;
    struct CUgraph_st *c = move ? child : fake_graph_clone(child);
    if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
    *node = fake_graph_node(g, CU_GRAPH_NODE_TYPE_GRAPH);
    if (!*node) {
        if (!move) fake_graph_free(c);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    c->owned = 1;
    (*node)->child = c;
    (*node)->nin = ndeps;
    (*node)->duration_ns = c->duration_ns;
    (*node)->mem_bytes = c->mem_bytes;
    g->duration_ns += c->duration_ns;
    g->mem_bytes += c->mem_bytes;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuGraphAddChildGraphNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                              CUgraph child)
{
    return add_child(node, g, deps, ndeps, child, CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE);
}

FAKE_EXPORT CUresult cuGraphChildGraphNodeGetGraph(CUgraphNode node, CUgraph *child)
{
    CHECK_INIT();
    if (!node || !child || node->type != CU_GRAPH_NODE_TYPE_GRAPH) return CUDA_ERROR_INVALID_VALUE;
    *child = node->child;
    return CUDA_SUCCESS;
}

static int zero(const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i]) return 0;
    return 1;
}

/* cuGraphAddNode: each node type through the call of its own; the types the double does not model
 * (external semaphores, batch memory operations, conditionals) answer CUDA_ERROR_NOT_SUPPORTED. */
FAKE_EXPORT CUresult cuGraphAddNode_v2(CUgraphNode *node, CUgraph g, const CUgraphNode *deps,
                                       const CUgraphEdgeData *edges, size_t ndeps, CUgraphNodeParams *p)
{
    CHECK_INIT();
    if (!node || !g || !p || !zero(p->reserved0, sizeof(p->reserved0)) || p->reserved2) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; edges && i < ndeps; i++) /* only the default edge is modeled */
        if (edges[i].type != CU_GRAPH_DEPENDENCY_TYPE_DEFAULT || edges[i].from_port || edges[i].to_port)
            return CUDA_ERROR_NOT_SUPPORTED;
    switch (p->type) {
    case CU_GRAPH_NODE_TYPE_EMPTY: return cuGraphAddEmptyNode(node, g, deps, ndeps);
    case CU_GRAPH_NODE_TYPE_KERNEL: {
        CUfunction f = p->kernel.func;
        if (!f && p->kernel.kern && cuKernelGetFunction(&f, p->kernel.kern) != CUDA_SUCCESS)
            return CUDA_ERROR_INVALID_VALUE;
        CUDA_KERNEL_NODE_PARAMS k;
        memset(&k, 0, sizeof(k));
        k.func = f;
        k.gridDimX = p->kernel.gridDimX;
        k.gridDimY = p->kernel.gridDimY;
        k.gridDimZ = p->kernel.gridDimZ;
        k.blockDimX = p->kernel.blockDimX;
        k.blockDimY = p->kernel.blockDimY;
        k.blockDimZ = p->kernel.blockDimZ;
        k.sharedMemBytes = p->kernel.sharedMemBytes;
        k.kernelParams = p->kernel.kernelParams;
        k.extra = p->kernel.extra;
        return cuGraphAddKernelNode_v2(node, g, deps, ndeps, &k);
    }
    case CU_GRAPH_NODE_TYPE_MEMCPY:
        if (p->memcpy.flags || p->memcpy.reserved) return CUDA_ERROR_INVALID_VALUE;
        return cuGraphAddMemcpyNode(node, g, deps, ndeps, &p->memcpy.copyParams, p->memcpy.copyCtx);
    case CU_GRAPH_NODE_TYPE_MEMSET: {
        CUDA_MEMSET_NODE_PARAMS m = {.dst = p->memset.dst,
                                     .pitch = p->memset.pitch,
                                     .value = p->memset.value,
                                     .elementSize = p->memset.elementSize,
                                     .width = p->memset.width,
                                     .height = p->memset.height};
        return cuGraphAddMemsetNode(node, g, deps, ndeps, &m, p->memset.ctx);
    }
    case CU_GRAPH_NODE_TYPE_HOST: {
        CUDA_HOST_NODE_PARAMS h = {.fn = p->host.fn, .userData = p->host.userData};
        return cuGraphAddHostNode(node, g, deps, ndeps, &h);
    }
    case CU_GRAPH_NODE_TYPE_GRAPH: return add_child(node, g, deps, ndeps, p->graph.graph, p->graph.ownership);
    case CU_GRAPH_NODE_TYPE_WAIT_EVENT: return cuGraphAddEventWaitNode(node, g, deps, ndeps, p->eventWait.event);
    case CU_GRAPH_NODE_TYPE_EVENT_RECORD: return cuGraphAddEventRecordNode(node, g, deps, ndeps, p->eventRecord.event);
    case CU_GRAPH_NODE_TYPE_MEM_ALLOC: {
        CUDA_MEM_ALLOC_NODE_PARAMS a = {.poolProps = p->alloc.poolProps,
                                        .accessDescs = p->alloc.accessDescs,
                                        .accessDescCount = p->alloc.accessDescCount,
                                        .bytesize = p->alloc.bytesize};
        CUresult rc = cuGraphAddMemAllocNode(node, g, deps, ndeps, &a);
        if (rc == CUDA_SUCCESS) p->alloc.dptr = a.dptr;
        return rc;
    }
    case CU_GRAPH_NODE_TYPE_MEM_FREE: return cuGraphAddMemFreeNode(node, g, deps, ndeps, p->free.dptr);
    default: return CUDA_ERROR_NOT_SUPPORTED;
    }
}

FAKE_EXPORT CUresult cuGraphAddNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                    CUgraphNodeParams *p)
{
    return cuGraphAddNode_v2(node, g, deps, NULL, ndeps, p);
}

FAKE_EXPORT CUresult cuGraphAddDependencies_v2(CUgraph g, const CUgraphNode *from, const CUgraphNode *to,
                                               const CUgraphEdgeData *edges, size_t n)
{
    CHECK_INIT();
    if (!g || (n && (!from || !to))) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < n; i++) {
        if (!in_graph(g, from[i]) || !in_graph(g, to[i]) || from[i] == to[i]) return CUDA_ERROR_INVALID_VALUE;
        if (edges && (edges[i].type != CU_GRAPH_DEPENDENCY_TYPE_DEFAULT || edges[i].from_port || edges[i].to_port))
            return CUDA_ERROR_NOT_SUPPORTED;
    }
    for (size_t i = 0; i < n; i++) to[i]->nin++;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuGraphAddDependencies(CUgraph g, const CUgraphNode *from, const CUgraphNode *to, size_t n)
{
    return cuGraphAddDependencies_v2(g, from, to, NULL, n);
}

/* ---------------------------------------------------------------- kernel node parameters */

static CUresult kernel_duration(const CUDA_KERNEL_NODE_PARAMS *p, uint64_t *d)
{
    if (!p || !p->func || p->func->magic != FUNC_MAGIC) return CUDA_ERROR_INVALID_VALUE;
    *d = fake_kernel_duration(p->func, p->gridDimX, p->gridDimY, p->gridDimZ, p->blockDimX, p->blockDimY, p->blockDimZ);
    return CUDA_SUCCESS;
}

/* A graph's kernel node takes new parameters: its function and grid set its duration from then on. */
FAKE_EXPORT CUresult cuGraphKernelNodeSetParams_v2(CUgraphNode node, const CUDA_KERNEL_NODE_PARAMS *p)
{
    CHECK_INIT();
    uint64_t d;
    if (!node || node->type != CU_GRAPH_NODE_TYPE_KERNEL || kernel_duration(p, &d)) return CUDA_ERROR_INVALID_VALUE;
    node->graph->duration_ns = node->graph->duration_ns - node->duration_ns + d;
    node->duration_ns = d;
    return CUDA_SUCCESS;
}

/* An executable graph's kernel node takes new parameters, the graph it came from unchanged. */
FAKE_EXPORT CUresult cuGraphExecKernelNodeSetParams_v2(CUgraphExec e, CUgraphNode node, const CUDA_KERNEL_NODE_PARAMS *p)
{
    CHECK_INIT();
    uint64_t d;
    if (!e || !node || node->type != CU_GRAPH_NODE_TYPE_KERNEL || kernel_duration(p, &d)) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < e->nk; i++)
        if (e->knodes[i] == node) {
            e->duration_ns = e->duration_ns - e->kdur[i] + d;
            e->kdur[i] = d;
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_INVALID_VALUE; /* not a node of the graph it was instantiated from */
}

/* ---------------------------------------------------------------- capture into an existing graph */

FAKE_EXPORT CUresult cuStreamBeginCaptureToGraph(CUstream s, CUgraph g, const CUgraphNode *deps,
                                                 const CUgraphEdgeData *edges, size_t ndeps, CUstreamCaptureMode mode)
{
    (void)mode;
    (void)edges;
    CHECK_INIT();
    if (!s || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (!g || g->owned || fake_graph_deps(g, NULL, deps, ndeps)) return CUDA_ERROR_INVALID_VALUE;
    if (s->capturing) return CUDA_ERROR_ILLEGAL_STATE;
    s->capture_graph = g; /* cuStreamEndCapture hands back this same graph */
    s->capturing = CU_STREAM_CAPTURE_STATUS_ACTIVE;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuStreamBeginCaptureToGraph_ptsz(CUstream s, CUgraph g, const CUgraphNode *deps,
                                                      const CUgraphEdgeData *edges, size_t ndeps,
                                                      CUstreamCaptureMode mode)
{
    return cuStreamBeginCaptureToGraph(s, g, deps, edges, ndeps, mode);
}
