/* Output panels shared out between OpenMP threads as runs: each thread takes the panels of its
 * own run of consecutive ones front to back, so it knows the next one and can prefetch its
 * weights while it multiplies the current one; a thread done with its run takes the others'
 * last panels, so a thread the gateway or a client preempts still hands its work over (as a
 * dynamic schedule does). Used by cpu_bf16_matmul.c, cpu_int16_matmul.c (their output panels)
 * and cpu_paged_attention.c (its work items). */
#ifndef CPU_PANEL_RUNS_H
#define CPU_PANEL_RUNS_H

#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>

/* Panels [first, end) of a run, packed in one word (first in the low half) so that a thread
 * taking one from the front and another taking one from the back never take the same. */
typedef struct {
    _Atomic uint64_t span;
    char pad[56]; /* a cache line each */
} panel_run;

/* `panels` split into `count` runs (count: the threads the parallel region will have). */
static inline void start_runs(panel_run *runs, int count, int64_t panels) {
    for (int r = 0; r < count; r++)
        atomic_store(&runs[r].span, (uint64_t)(panels * r / count)
                                    | (uint64_t)(panels * (r + 1) / count) << 32);
}

/* The run's first panel (from_back = 0) or its last, taken; -1 once the run is empty. */
static inline int64_t take_panel(panel_run *run, int from_back) {
    uint64_t span = atomic_load(&run->span);
    for (;;) {
        const uint64_t first = span & 0xffffffffu, end = span >> 32;
        if (first >= end) return -1;
        const uint64_t rest = from_back ? first | (end - 1) << 32 : (first + 1) | end << 32;
        if (atomic_compare_exchange_weak(&run->span, &span, rest))
            return from_back ? (int64_t)end - 1 : (int64_t)first;
    }
}

/* The panel the run's owner takes next, or -1. */
static inline int64_t next_panel(panel_run *run) {
    const uint64_t span = atomic_load(&run->span);
    return (span & 0xffffffffu) < span >> 32 ? (int64_t)(span & 0xffffffffu) : -1;
}

/* Inside a parallel region, over the `count` runs start_runs set: thread t works through
 * run t, then takes the last panels of the others (of every run, should the region have fewer
 * threads than runs). */
static inline void take_panels(panel_run *runs, int count,
                               void (*do_panel)(void *context, int64_t p, int64_t next),
                               void *context) {
    const int me = omp_get_thread_num();
    int64_t p;
    if (me < count)
        while ((p = take_panel(&runs[me], 0)) >= 0) do_panel(context, p, next_panel(&runs[me]));
    for (int other = 1; other <= count; other++)
        while ((p = take_panel(&runs[(me + other) % count], 1)) >= 0) do_panel(context, p, -1);
}

/* do_panel(context, p, next) for every panel p in [0, panels) exactly once, over the OpenMP
 * threads, next being the panel the calling thread takes after p (-1: none known), so that
 * do_panel can prefetch it. The runs are set before the parallel region: no barrier in it. */
static inline void for_each_panel(int64_t panels,
                                  void (*do_panel)(void *context, int64_t p, int64_t next),
                                  void *context) {
    const int threads = omp_get_max_threads();
    panel_run runs[threads];
    start_runs(runs, threads, panels);
    #pragma omp parallel
    take_panels(runs, threads, do_panel, context);
}

#endif
