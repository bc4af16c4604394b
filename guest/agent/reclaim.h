/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Guest reclaimer: gives cold page cache back so that free page reporting
 * can return it to the host.  See docs/working-set.md for the policy and
 * docs/protocol/agent.md for the TRIM and RECLAIM requests.
 */
#ifndef THINVM_RECLAIM_H
#define THINVM_RECLAIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Longest JSON object any reclaim request answers with. */
#define RECLAIM_JSON_MAX	2048

/*
 * Find memory.reclaim and start the background thread, idle unless
 * `background` is set.  Never fails: a guest without cgroup v2 or
 * memory.reclaim answers every request with "available": false.
 */
void reclaim_init(bool background);

/* One "trim now", bounded by bytes (0: no bound) and time. */
int reclaim_trim(uint64_t max_bytes, unsigned int timeout_ms, char *out,
		 size_t size);

/* Switch continuous background reclaim on or off; answers the status. */
int reclaim_set_background(bool on, char *out, size_t size);

/* The counters, as one JSON object. */
int reclaim_status(char *out, size_t size);

#endif
