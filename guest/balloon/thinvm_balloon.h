/* SPDX-License-Identifier: GPL-2.0 */
/*
 * thinvm_balloon: out-of-tree virtio memory balloon driver.
 *
 * Internal declarations shared by the source files of the module.
 */
#ifndef THINVM_BALLOON_H
#define THINVM_BALLOON_H

#include <linux/atomic.h>
#include <linux/balloon_compaction.h>
#include <linux/mutex.h>
#include <linux/notifier.h>
#include <linux/page_reporting.h>
#include <linux/spinlock.h>
#include <linux/virtio.h>
#include <linux/vmstat.h>
#include <linux/wait.h>
#include <linux/workqueue.h>

#include "compat.h"

/*
 * The device speaks in 4 KiB "balloon pages" whatever the guest page size
 * is.  All page counts in this driver are balloon pages unless a name
 * says otherwise.
 */
#define TB_PAGES_PER_PAGE	((unsigned int)(PAGE_SIZE >> VIRTIO_BALLOON_PFN_SHIFT))
/* PFNs carried by one inflate or deflate request. */
#define TB_PFNS_PER_REQ		256

/*
 * VIRTIO_BALLOON_F_RANGES, a thinvm extension specified in
 * docs/protocol/balloon-ranges.md: inflateq and deflateq carry arrays of
 * struct virtio_balloon_range instead of frame numbers, and the device
 * advertises its backing granule in range_granule_shift.
 */
#ifndef VIRTIO_BALLOON_F_RANGES
#define VIRTIO_BALLOON_F_RANGES	23
#endif

/* Wire format of one range (little-endian, 16 bytes). */
struct virtio_balloon_range {
	__le64 addr;	/* guest physical address of the first byte */
	__le64 len;	/* length in bytes */
};

/*
 * The device's configuration space, with the field that RANGES appends
 * after poison_val.  Used only to read that field.
 */
struct thinvm_balloon_config {
	__le32 num_pages;
	__le32 actual;
	__le32 free_page_hint_cmd_id;
	__le32 poison_val;
	__le32 range_granule_shift;	/* VIRTIO_BALLOON_F_RANGES */
};

/* Ranges carried by one request: one 4 KiB buffer. */
#define TB_RANGES_PER_REQ	256
/* Most balloon pages one range inflate or deflate round moves: 512 MiB. */
#define TB_RANGE_ROUND_PAGES	(TB_RANGES_PER_REQ * 512U)

/* Free page hint blocks are the largest buddy blocks. */
#define TB_HINT_ORDER		THINVM_MAX_PAGE_ORDER
#define TB_HINT_BLOCK_PAGES	BIT(TB_HINT_ORDER)

/* The device's virtqueues, in its order; only negotiated ones exist. */
enum tb_vq {
	TB_VQ_INFLATE,
	TB_VQ_DEFLATE,
	TB_VQ_STATS,
	TB_VQ_HINT,
	TB_VQ_REPORT,
	TB_VQ_MAX
};

struct thinvm_balloon {
	struct virtio_device *vdev;
	struct virtqueue *inflate_vq;
	struct virtqueue *deflate_vq;
	struct virtqueue *stats_vq;
	struct virtqueue *hint_vq;
	struct virtqueue *report_vq;

	/* Inflate/deflate towards the target; delayed to back off. */
	struct delayed_work size_work;
	/* The last inflate attempt found no free memory. */
	bool inflate_stuck;
	/* Refill the stats buffer when the device asks for it. */
	struct work_struct stats_work;

	/*
	 * Device requests (TB_WAKE_*) not yet handled.  While any is
	 * pending, or its work item is running, the device's wakeup source
	 * is held so that the system does not suspend under the host.
	 */
	spinlock_t wake_lock;
	unsigned int wake_pending;
	bool wake_held;

	/* Set once remove/freeze has started: no new work is queued. */
	spinlock_t stop_lock;
	bool stopping;

	/* Woken by the inflate, deflate and reporting queues. */
	wait_queue_head_t acked;

	/*
	 * Serialises inflate, deflate and migration: they share pfns[] and
	 * num_pages.
	 */
	struct mutex lock;
	/* Balloon pages the device has been told we gave up. */
	unsigned int num_pages;
	/* Pages in the balloon, with their compaction hooks. */
	struct balloon_dev_info b_dev_info;
	__virtio32 pfns[TB_PFNS_PER_REQ];

	/* VIRTIO_BALLOON_F_STATS_VQ: the buffer the device reads. */
	struct virtio_balloon_stat stats[THINVM_BALLOON_S_MAX];
	/* Scratch copy of the VM event counters, too big for the stack. */
	unsigned long events[NR_VM_EVENT_ITEMS];

	/* VIRTIO_BALLOON_F_DEFLATE_ON_OOM */
	struct notifier_block oom_nb;

	/* VIRTIO_BALLOON_F_FREE_PAGE_HINT */
	struct workqueue_struct *hint_wq;
	struct work_struct hint_work;
	/* Bit 0 set: the config space cmd id must be re-read. */
	unsigned long hint_cmd_dirty;
	u32 hint_cmd_id;
	/* The id of the hinting run in progress, as sent to the device. */
	__virtio32 hint_cmd_active;
	__virtio32 hint_cmd_stop;
	/* Blocks handed to the device, kept until DONE or memory pressure. */
	spinlock_t hint_lock;
	struct list_head hint_blocks;
	unsigned long hint_nr_blocks;
	struct shrinker *hint_shrinker;

	/* VIRTIO_BALLOON_F_REPORTING */
	struct page_reporting_dev_info pr_dev_info;
	bool reporting;

	/*
	 * VIRTIO_BALLOON_F_RANGES.  Deflate and migration build their
	 * requests in ranges[] under tb->lock; inflate builds its request in
	 * inflate_ranges[] while it allocates, before taking tb->lock, and
	 * only the resize work item inflates.
	 */
	struct virtio_balloon_range *ranges;
	struct virtio_balloon_range *inflate_ranges;
	/* Preferred block order, from the device's range_granule_shift. */
	unsigned int range_order;
	/*
	 * Blocks of at least pageblock_order, kept whole and unmovable
	 * (see ranges.c), newest first, each with its order in
	 * page_private().  Under tb->lock.
	 */
	struct list_head whole_blocks;
	/* Balloon pages in whole_blocks; the rest are on b_dev_info. */
	unsigned int whole_pages;
};

#define TB_WAKE_RESIZE		BIT(0)
#define TB_WAKE_STATS		BIT(1)

/* main.c */
void tb_wake_begin(struct thinvm_balloon *tb, unsigned int why);
void tb_wake_end(struct thinvm_balloon *tb);
bool tb_has(const struct thinvm_balloon *tb, unsigned int fbit);
void tb_vq_ack(struct virtqueue *vq);
void tb_queue_work(struct thinvm_balloon *tb, struct workqueue_struct *wq,
		   struct work_struct *work, unsigned int wake);
unsigned int tb_deflate(struct thinvm_balloon *tb, unsigned int want,
			bool whole_blocks, bool *stuck);
void tb_update_actual(struct thinvm_balloon *tb);
int tb_send(struct thinvm_balloon *tb, struct virtqueue *vq, void *buf,
	    unsigned int len);
void tb_account(struct thinvm_balloon *tb, struct page *page, long n);
void tb_release_pages(struct thinvm_balloon *tb, struct list_head *pages);

/* stats.c */
void tb_stats_request(struct virtqueue *vq);
int tb_stats_setup(struct thinvm_balloon *tb);
void tb_stats_start(struct thinvm_balloon *tb);

/* hint.c */
int tb_hint_setup(struct thinvm_balloon *tb);
void tb_hint_teardown(struct thinvm_balloon *tb);
void tb_hint_config_changed(struct thinvm_balloon *tb);
void tb_hint_reset(struct thinvm_balloon *tb);
unsigned long tb_hint_release(struct thinvm_balloon *tb, unsigned long nr);

/* oom.c */
int tb_oom_setup(struct thinvm_balloon *tb);
void tb_oom_teardown(struct thinvm_balloon *tb);

/* ranges.c */
int tb_ranges_setup(struct thinvm_balloon *tb);
void tb_ranges_teardown(struct thinvm_balloon *tb);
void tb_ranges_start(struct thinvm_balloon *tb);
unsigned int tb_ranges_inflate(struct thinvm_balloon *tb, unsigned int want,
			       bool *stuck);
unsigned int tb_ranges_deflate(struct thinvm_balloon *tb, unsigned int want,
			       bool whole_blocks, bool *stuck);
void tb_ranges_tell_page(struct thinvm_balloon *tb, struct virtqueue *vq,
			 struct page *page);

/* report.c */
void tb_poison_setup(struct thinvm_balloon *tb);
void tb_report_setup(struct thinvm_balloon *tb);
void tb_report_teardown(struct thinvm_balloon *tb);

/* counters.c: module-wide, summed over all balloon devices. */
enum tb_counter {
	TB_INFLATED_PAGES,	/* in the balloon now */
	TB_INFLATED_TOTAL,
	TB_DEFLATED_TOTAL,
	TB_INFLATE_REQUESTS,
	TB_DEFLATE_REQUESTS,
	TB_ALLOC_FAILURES,
	TB_OOM_DEFLATIONS,
	TB_OOM_DEFLATED_PAGES,
	TB_MIGRATED_PAGES,
	TB_STATS_UPDATES,
	TB_HINT_RUNS,
	TB_HINT_BLOCKS,
	TB_HINT_BLOCKS_HELD,	/* held now */
	TB_HINT_BLOCKS_SHRUNK,
	TB_REPORT_REQUESTS,
	TB_REPORT_PAGES,
	TB_RANGE_REQUESTS,
	TB_RANGES_SENT,
	TB_HUGE_BLOCKS,
	TB_SMALL_BLOCKS,
	TB_WHOLE_BLOCKS_HELD,	/* held now */
	TB_WHOLE_BLOCKS_SPLIT,
	TB_DEFLATED_BLOCKS,
	TB_REPORT_NOW_RUNS,
	TB_REPORT_NOW_PASSES,
	TB_NR_COUNTERS
};

extern atomic_long_t tb_counters[TB_NR_COUNTERS];
/* Effective free page reporting order, -1 while reporting is off. */
extern int tb_report_order_now;
/* Blocks inflated in range mode, by order. */
extern atomic_long_t tb_blocks_by_order[THINVM_MAX_PAGE_ORDER + 1];
/* Range granule shift and preferred block order, -1 without RANGES. */
extern int tb_range_shift_now;
extern int tb_range_order_now;

static inline void tb_count(enum tb_counter c, long n)
{
	atomic_long_add(n, &tb_counters[c]);
}

void tb_debugfs_init(void);
void tb_debugfs_exit(void);

#endif /* THINVM_BALLOON_H */
