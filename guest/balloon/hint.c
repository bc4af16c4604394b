// SPDX-License-Identifier: GPL-2.0
/*
 * thinvm_balloon: free page hinting (VIRTIO_BALLOON_F_FREE_PAGE_HINT).
 *
 * Used by the host during live migration to skip memory the guest does
 * not need.  The device starts a hinting run by writing a new command id
 * to free_page_hint_cmd_id.  The driver answers with:
 *
 *   1. an out buffer holding that id (start of run);
 *   2. in buffers, each one free block of 2^TB_HINT_ORDER pages that the
 *      driver allocated so the guest cannot use it meanwhile;
 *   3. an out buffer holding VIRTIO_BALLOON_CMD_ID_STOP (end of run).
 *
 * The run ends early when the device writes another id (STOP, DONE or a
 * new run).  The blocks stay allocated until the device writes
 * VIRTIO_BALLOON_CMD_ID_DONE, meaning it no longer looks at them.  They
 * may be freed earlier under memory pressure (the shrinker below): a
 * page the guest writes after the hint is dirty again and gets migrated
 * anyway, so giving a block back early is always safe, merely less
 * useful.
 *
 * Hinted pages are never discarded by the device, so page poisoning does
 * not matter here: the blocks go back through the page allocator, which
 * poisons or zeroes them on free as usual.
 */
#include <linux/gfp.h>
#include <linux/mm.h>
#include <linux/scatterlist.h>
#include <linux/sched.h>

#include "thinvm_balloon.h"

/*
 * Only take memory that is free right now: no reclaim, no retrying, no
 * emergency reserves, no warnings when there is none left.
 */
#define TB_HINT_GFP	(__GFP_NORETRY | __GFP_NOWARN | __GFP_NOMEMALLOC)

#define TB_HINT_CMD_DIRTY	0

/* The current command id, re-read from config space after a change. */
static u32 tb_hint_cmd_id(struct thinvm_balloon *tb)
{
	if (test_and_clear_bit(TB_HINT_CMD_DIRTY, &tb->hint_cmd_dirty))
		virtio_cread_le(tb->vdev, struct virtio_balloon_config,
				free_page_hint_cmd_id, &tb->hint_cmd_id);
	return tb->hint_cmd_id;
}

static bool tb_hint_run_cancelled(struct thinvm_balloon *tb)
{
	return tb_hint_cmd_id(tb) !=
	       virtio32_to_cpu(tb->vdev, tb->hint_cmd_active);
}

static void tb_hint_reap(struct thinvm_balloon *tb)
{
	unsigned int len;

	while (virtqueue_get_buf(tb->hint_vq, &len))
		;
}

/* Queue the 4-byte command id at @id as an out buffer. */
static int tb_hint_send_id(struct thinvm_balloon *tb, __virtio32 *id)
{
	struct scatterlist sg;
	int err;

	tb_hint_reap(tb);
	sg_init_one(&sg, id, sizeof(*id));
	err = virtqueue_add_outbuf(tb->hint_vq, &sg, 1, id, GFP_KERNEL);
	if (!err)
		virtqueue_kick(tb->hint_vq);
	return err;
}

static void tb_hint_keep(struct thinvm_balloon *tb, struct page *block)
{
	spin_lock(&tb->hint_lock);
	list_add(&block->lru, &tb->hint_blocks);
	tb->hint_nr_blocks++;
	spin_unlock(&tb->hint_lock);
	tb_count(TB_HINT_BLOCKS, 1);
	tb_count(TB_HINT_BLOCKS_HELD, 1);
}

/*
 * Hand one free block to the device.  Returns 0 when it was queued,
 * -ENOMEM when the guest has no free block of that size left (the run is
 * complete), -ECANCELED when the device ended the run, or another error.
 */
static int tb_hint_one(struct thinvm_balloon *tb)
{
	struct scatterlist sg;
	struct page *block;
	int err;

	block = alloc_pages(TB_HINT_GFP, TB_HINT_ORDER);
	if (!block)
		return -ENOMEM;

	/* One descriptor is always left free for the stop id. */
	for (;;) {
		tb_hint_reap(tb);
		if (tb->hint_vq->num_free > 1)
			break;
		if (tb_hint_run_cancelled(tb)) {
			__free_pages(block, TB_HINT_ORDER);
			return -ECANCELED;
		}
		cond_resched();
	}

	sg_init_one(&sg, page_address(block), PAGE_SIZE << TB_HINT_ORDER);
	err = virtqueue_add_inbuf(tb->hint_vq, &sg, 1, block, GFP_KERNEL);
	if (err) {
		__free_pages(block, TB_HINT_ORDER);
		return err;
	}
	virtqueue_kick(tb->hint_vq);
	tb_hint_keep(tb, block);
	return 0;
}

static void tb_hint_run(struct thinvm_balloon *tb, u32 id)
{
	struct device *dev = &tb->vdev->dev;
	int err;

	tb->hint_cmd_active = cpu_to_virtio32(tb->vdev, id);
	err = tb_hint_send_id(tb, &tb->hint_cmd_active);
	if (err) {
		dev_err(dev, "cannot start free page hinting: %d\n", err);
		return;
	}
	tb_count(TB_HINT_RUNS, 1);

	while (!tb_hint_run_cancelled(tb)) {
		err = tb_hint_one(tb);
		if (err)
			break;
		cond_resched();
	}
	if (err && err != -ENOMEM && err != -ECANCELED)
		dev_err(dev, "free page hinting stopped early: %d\n", err);

	err = tb_hint_send_id(tb, &tb->hint_cmd_stop);
	if (err)
		dev_err(dev, "cannot stop free page hinting: %d\n", err);
}

static void tb_hint_work(struct work_struct *work)
{
	struct thinvm_balloon *tb = container_of(work, struct thinvm_balloon,
						 hint_work);
	u32 id = tb_hint_cmd_id(tb);

	if (id == VIRTIO_BALLOON_CMD_ID_DONE) {
		tb_hint_release(tb, ULONG_MAX);
		return;
	}
	if (id == VIRTIO_BALLOON_CMD_ID_STOP ||
	    id == virtio32_to_cpu(tb->vdev, tb->hint_cmd_active))
		return;
	tb_hint_run(tb, id);
}

/* Config change callback: the command id may have changed. */
void tb_hint_config_changed(struct thinvm_balloon *tb)
{
	/* A pending work item will read the new id anyway. */
	if (test_and_set_bit(TB_HINT_CMD_DIRTY, &tb->hint_cmd_dirty))
		return;
	tb_queue_work(tb, tb->hint_wq, &tb->hint_work, 0);
}

/* Give up to @nr held blocks back to the page allocator. */
unsigned long tb_hint_release(struct thinvm_balloon *tb, unsigned long nr)
{
	unsigned long done = 0;
	struct page *block;

	spin_lock(&tb->hint_lock);
	while (done < nr) {
		block = list_first_entry_or_null(&tb->hint_blocks,
						 struct page, lru);
		if (!block)
			break;
		list_del(&block->lru);
		__free_pages(block, TB_HINT_ORDER);
		done++;
	}
	tb->hint_nr_blocks -= done;
	spin_unlock(&tb->hint_lock);

	tb_count(TB_HINT_BLOCKS_HELD, -(long)done);
	return done;
}

static unsigned long tb_hint_count(struct shrinker *s,
				   struct shrink_control *sc)
{
	struct thinvm_balloon *tb = thinvm_shrinker_priv(s);
	unsigned long blocks = READ_ONCE(tb->hint_nr_blocks);

	return blocks ? blocks * TB_HINT_BLOCK_PAGES : SHRINK_EMPTY;
}

static unsigned long tb_hint_scan(struct shrinker *s,
				  struct shrink_control *sc)
{
	struct thinvm_balloon *tb = thinvm_shrinker_priv(s);
	unsigned long blocks;

	blocks = tb_hint_release(tb, DIV_ROUND_UP(sc->nr_to_scan,
						  TB_HINT_BLOCK_PAGES));
	tb_count(TB_HINT_BLOCKS_SHRUNK, blocks);
	return blocks ? blocks * TB_HINT_BLOCK_PAGES : SHRINK_STOP;
}

/* Forget any run that was in progress: the device was reset. */
void tb_hint_reset(struct thinvm_balloon *tb)
{
	tb->hint_cmd_id = VIRTIO_BALLOON_CMD_ID_STOP;
	tb->hint_cmd_active = cpu_to_virtio32(tb->vdev,
					      VIRTIO_BALLOON_CMD_ID_STOP);
	tb->hint_cmd_stop = cpu_to_virtio32(tb->vdev,
					    VIRTIO_BALLOON_CMD_ID_STOP);
	clear_bit(TB_HINT_CMD_DIRTY, &tb->hint_cmd_dirty);
}

int tb_hint_setup(struct thinvm_balloon *tb)
{
	spin_lock_init(&tb->hint_lock);
	INIT_LIST_HEAD(&tb->hint_blocks);
	INIT_WORK(&tb->hint_work, tb_hint_work);
	tb_hint_reset(tb);

	/*
	 * Hinting allocates and queues blocks in a tight loop for as long
	 * as memory is free: give it its own CPU-intensive queue rather
	 * than hold up the system one.
	 */
	tb->hint_wq = alloc_workqueue("thinvm_balloon_hint",
				      WQ_FREEZABLE | WQ_CPU_INTENSIVE, 0);
	if (!tb->hint_wq)
		return -ENOMEM;

	/* The blocks are ours to take back whenever memory gets tight. */
	tb->hint_shrinker = thinvm_shrinker_create("thinvm_balloon_hint",
						   tb_hint_count,
						   tb_hint_scan, tb);
	if (!tb->hint_shrinker) {
		destroy_workqueue(tb->hint_wq);
		return -ENOMEM;
	}
	return 0;
}

void tb_hint_teardown(struct thinvm_balloon *tb)
{
	thinvm_shrinker_destroy(tb->hint_shrinker);
	cancel_work_sync(&tb->hint_work);
	destroy_workqueue(tb->hint_wq);
	tb_hint_release(tb, ULONG_MAX);
}
