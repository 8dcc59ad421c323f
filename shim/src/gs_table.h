/*
 * Lock-free map from a driver object (device pointer, VMM handle, array) to the bytes charged for it,
 * so frees credit exactly what the allocation reserved. Open addressing with linear probing over an
 * anonymous mapping populated when the shim initializes (on the first CUDA call, not at load).
 *
 * Keys are inserted by the allocating thread and removed by the freeing thread; the application's own
 * synchronization orders an allocation before its free. Removed slots become tombstones that later
 * inserts reuse. Keys 0 and 1 are reserved (empty, tombstone): no driver returns them for a live object.
 */
#ifndef GS_TABLE_H
#define GS_TABLE_H

#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#define GS_TABLE_EMPTY 0u
#define GS_TABLE_TOMB 1u

typedef struct {
    _Atomic uint64_t key;
    _Atomic uint64_t val;
} gs_slot;

typedef struct {
    gs_slot *slots;
    uint64_t mask;
} gs_table;

static inline int gs_table_init(gs_table *t, unsigned log2_slots)
{
    size_t n = (size_t)1 << log2_slots;
    /* Populated up front: first-touch page faults would otherwise land on the allocation fast path. */
    void *p = mmap(NULL, n * sizeof(gs_slot), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                   -1, 0);
    if (p == MAP_FAILED) return -1;
    t->slots = p;
    t->mask = n - 1;
    return 0;
}

/* Forgets every entry (a forked child owns none of its parent's driver objects). */
static inline void gs_table_clear(gs_table *t)
{
    if (t->slots) memset(t->slots, 0, (t->mask + 1) * sizeof(gs_slot));
}

static inline uint64_t gs_table_hash(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return k;
}

/* 0 on success, -1 when the table is full. */
static inline int gs_table_put(gs_table *t, uint64_t key, uint64_t val)
{
    uint64_t i = gs_table_hash(key) & t->mask;
    for (uint64_t n = 0; n <= t->mask; n++, i = (i + 1) & t->mask) {
        uint64_t k = atomic_load_explicit(&t->slots[i].key, memory_order_relaxed);
        while (k == GS_TABLE_EMPTY || k == GS_TABLE_TOMB) {
            if (atomic_compare_exchange_weak_explicit(&t->slots[i].key, &k, key, memory_order_relaxed,
                                                      memory_order_relaxed)) {
                atomic_store_explicit(&t->slots[i].val, val, memory_order_release);
                return 0;
            }
        }
    }
    return -1;
}

/* The slot holding key, or NULL when the key is unknown. */
static inline gs_slot *gs_table_find(gs_table *t, uint64_t key)
{
    if (key <= GS_TABLE_TOMB) return NULL;
    uint64_t i = gs_table_hash(key) & t->mask;
    for (uint64_t n = 0; n <= t->mask; n++, i = (i + 1) & t->mask) {
        uint64_t k = atomic_load_explicit(&t->slots[i].key, memory_order_acquire);
        if (k == GS_TABLE_EMPTY) return NULL;
        if (k == key) return &t->slots[i];
    }
    return NULL;
}

/* Looks key up without removing it; -1 when unknown. */
static inline int gs_table_get(gs_table *t, uint64_t key, uint64_t *val)
{
    gs_slot *s = gs_table_find(t, key);
    if (!s) return -1;
    *val = atomic_load_explicit(&s->val, memory_order_acquire);
    return 0;
}

/* Removes key and returns its value through *val; -1 when the key is unknown. */
static inline int gs_table_take(gs_table *t, uint64_t key, uint64_t *val)
{
    gs_slot *s = gs_table_find(t, key);
    if (!s) return -1;
    *val = atomic_load_explicit(&s->val, memory_order_acquire);
    /* Only the owner of a live key removes it, so a plain CAS to tombstone cannot race a put. */
    uint64_t k = key;
    if (atomic_compare_exchange_strong_explicit(&s->key, &k, GS_TABLE_TOMB, memory_order_acq_rel, memory_order_relaxed))
        return 0;
    return -1;
}

#endif
