/* All-reduce (sum) of float32 activations between the tensor-parallel ranks of one host,
 * through a memory segment they all map (cpu_shm_allreduce.py).
 *
 * Each call: a rank copies its part into its slot of one of two slot sets (alternating by
 * call), waits at a barrier until every rank has, and sums the slots in rank order (the same
 * order on every rank, so every rank gets the same bits). Two slot sets need no second
 * barrier: a rank writes set k % 2 for call k only after passing call k-1's barrier, which
 * every rank reaches only after it has finished reading call k-2's sums from that set.
 *
 * The barrier waits on a futex, after a short spin: with more ranks than cores (3 ranks on
 * 2 cores) a spinning rank would hold the core the last one needs.
 */
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    _Atomic uint32_t arrived;
    _Atomic uint32_t generation;
} barrier_t;

static long futex(_Atomic uint32_t *addr, int op, uint32_t value, const struct timespec *timeout) {
    return syscall(SYS_futex, (uint32_t *)addr, op, value, timeout, NULL, 0);
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* 0 once every rank has arrived; -1 if timeout_s passed first. */
static int wait_all(barrier_t *barrier, int64_t world, double timeout_s, int64_t spins) {
    uint32_t generation = atomic_load(&barrier->generation);
    if (atomic_fetch_add(&barrier->arrived, 1) == (uint32_t)(world - 1)) {
        atomic_store(&barrier->arrived, 0);
        atomic_fetch_add(&barrier->generation, 1);
        futex(&barrier->generation, FUTEX_WAKE, INT_MAX, NULL);
        return 0;
    }
    for (int64_t i = 0; i < spins; i++) {
        if (atomic_load(&barrier->generation) != generation)
            return 0;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
    double deadline = now_s() + timeout_s;
    while (atomic_load(&barrier->generation) == generation) {
        double left = deadline - now_s();
        if (left <= 0)
            return -1;
        struct timespec timeout = {(time_t)left, (long)((left - (time_t)left) * 1e9)};
        futex(&barrier->generation, FUTEX_WAIT, generation, &timeout);
    }
    return 0;
}

/* data (n floats) += every other rank's data. segment: a barrier_t, padded to 64 bytes, then
 * two sets of world slots of slot_floats each. call: this rank's count of calls so far. */
int64_t shm_all_reduce(float *data, int64_t n, void *segment, int64_t slot_floats,
                       int64_t rank, int64_t world, int64_t call, double timeout_s,
                       int64_t spins) {
    barrier_t *barrier = (barrier_t *)segment;
    float *set = (float *)((char *)segment + 64) + (call & 1) * world * slot_floats;
    memcpy(set + rank * slot_floats, data, n * sizeof(float));
    if (wait_all(barrier, world, timeout_s, spins) != 0)
        return -1;
    memcpy(data, set, n * sizeof(float));
    for (int64_t r = 1; r < world; r++) {
        const float *part = set + r * slot_floats;
        for (int64_t i = 0; i < n; i++)
            data[i] += part[i];
    }
    return 0;
}
