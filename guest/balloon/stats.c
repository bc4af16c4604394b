// SPDX-License-Identifier: GPL-2.0
/*
 * thinvm_balloon: memory statistics (VIRTIO_BALLOON_F_STATS_VQ).
 *
 * The stats queue runs backwards compared to the others: the driver
 * keeps one buffer of statistics queued, the device "uses" it when it
 * wants fresh numbers, and the driver answers by queueing a new one.
 */
#include <linux/mm.h>
#include <linux/mmzone.h>
#include <linux/scatterlist.h>
#include <linux/swap.h>
#include <linux/vmstat.h>

#include "thinvm_balloon.h"

static unsigned int tb_put(struct thinvm_balloon *tb, unsigned int idx,
			   u16 tag, u64 val)
{
	if (WARN_ON_ONCE(idx >= ARRAY_SIZE(tb->stats)))
		return idx;
	tb->stats[idx].tag = cpu_to_virtio16(tb->vdev, tag);
	tb->stats[idx].val = cpu_to_virtio64(tb->vdev, val);
	return idx + 1;
}

static u64 tb_bytes(unsigned long pages)
{
	return (u64)pages << PAGE_SHIFT;
}

#ifdef CONFIG_VM_EVENT_COUNTERS
/* Tags that come from the VM event counters (/proc/vmstat). */
static unsigned int tb_fill_events(struct thinvm_balloon *tb,
				   unsigned int idx)
{
	unsigned long *ev = tb->events;
	unsigned long stalls = 0;
	int zone;

	all_vm_events(ev);

	idx = tb_put(tb, idx, VIRTIO_BALLOON_S_SWAP_IN, tb_bytes(ev[PSWPIN]));
	idx = tb_put(tb, idx, VIRTIO_BALLOON_S_SWAP_OUT, tb_bytes(ev[PSWPOUT]));
	idx = tb_put(tb, idx, VIRTIO_BALLOON_S_MAJFLT, ev[PGMAJFAULT]);
	idx = tb_put(tb, idx, VIRTIO_BALLOON_S_MINFLT, ev[PGFAULT]);
#ifdef CONFIG_HUGETLB_PAGE
	idx = tb_put(tb, idx, VIRTIO_BALLOON_S_HTLB_PGALLOC,
		     ev[HTLB_BUDDY_PGALLOC]);
	idx = tb_put(tb, idx, VIRTIO_BALLOON_S_HTLB_PGFAIL,
		     ev[HTLB_BUDDY_PGALLOC_FAIL]);
#endif
	idx = tb_put(tb, idx, VIRTIO_BALLOON_S_OOM_KILL, ev[OOM_KILL]);

	/*
	 * Direct reclaim stalls are counted per zone: ALLOCSTALL_<zone>
	 * items are laid out in enum zone_type order, one per zone.
	 */
	for (zone = 0; zone < MAX_NR_ZONES; zone++)
		stalls += ev[ALLOCSTALL_NORMAL - ZONE_NORMAL + zone];
	idx = tb_put(tb, idx, VIRTIO_BALLOON_S_ALLOC_STALL, stalls);

	idx = tb_put(tb, idx, VIRTIO_BALLOON_S_ASYNC_SCAN,
		     tb_bytes(ev[PGSCAN_KSWAPD]));
	idx = tb_put(tb, idx, VIRTIO_BALLOON_S_DIRECT_SCAN,
		     tb_bytes(ev[PGSCAN_DIRECT]));
	idx = tb_put(tb, idx, VIRTIO_BALLOON_S_ASYNC_RECLAIM,
		     tb_bytes(ev[PGSTEAL_KSWAPD]));
	idx = tb_put(tb, idx, VIRTIO_BALLOON_S_DIRECT_RECLAIM,
		     tb_bytes(ev[PGSTEAL_DIRECT]));
	return idx;
}
#else
static unsigned int tb_fill_events(struct thinvm_balloon *tb,
				   unsigned int idx)
{
	return idx;
}
#endif

/* Fill tb->stats; returns the number of entries. */
static unsigned int tb_stats_fill(struct thinvm_balloon *tb)
{
	struct sysinfo si;
	unsigned int idx;

	idx = tb_fill_events(tb, 0);

	si_meminfo(&si);
	idx = tb_put(tb, idx, VIRTIO_BALLOON_S_MEMFREE, tb_bytes(si.freeram));
	idx = tb_put(tb, idx, VIRTIO_BALLOON_S_MEMTOT, tb_bytes(si.totalram));
	idx = tb_put(tb, idx, VIRTIO_BALLOON_S_AVAIL,
		     tb_bytes(si_mem_available()));
	idx = tb_put(tb, idx, VIRTIO_BALLOON_S_CACHES,
		     tb_bytes(global_node_page_state(NR_FILE_PAGES)));
	return idx;
}

static int tb_stats_queue(struct thinvm_balloon *tb)
{
	struct scatterlist sg;
	unsigned int n = tb_stats_fill(tb);

	sg_init_one(&sg, tb->stats, sizeof(tb->stats[0]) * n);
	return virtqueue_add_outbuf(tb->stats_vq, &sg, 1, tb, GFP_KERNEL);
}

static void tb_stats_work(struct work_struct *work)
{
	struct thinvm_balloon *tb = container_of(work, struct thinvm_balloon,
						 stats_work);
	unsigned int len;

	tb_wake_begin(tb, TB_WAKE_STATS);
	/* Our one buffer comes back when the device wants fresh numbers. */
	if (virtqueue_get_buf(tb->stats_vq, &len) && !tb_stats_queue(tb)) {
		virtqueue_kick(tb->stats_vq);
		tb_count(TB_STATS_UPDATES, 1);
	}
	tb_wake_end(tb);
}

/*
 * Virtqueue callback, in interrupt context: collecting the numbers may
 * sleep, so do it from a freezable work item.
 */
void tb_stats_request(struct virtqueue *vq)
{
	struct thinvm_balloon *tb = vq->vdev->priv;

	tb_queue_work(tb, system_freezable_wq, &tb->stats_work, TB_WAKE_STATS);
}

/* Before DRIVER_OK: give the device its first buffer to hold on to. */
int tb_stats_setup(struct thinvm_balloon *tb)
{
	int err;

	INIT_WORK(&tb->stats_work, tb_stats_work);
	err = tb_stats_queue(tb);
	if (err)
		dev_warn(&tb->vdev->dev, "cannot queue stats buffer: %d\n",
			 err);
	return err;
}

/* After DRIVER_OK: notifications are allowed now. */
void tb_stats_start(struct thinvm_balloon *tb)
{
	virtqueue_kick(tb->stats_vq);
}
