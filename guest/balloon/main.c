// SPDX-License-Identifier: GPL-2.0
/*
 * thinvm_balloon: out-of-tree virtio memory balloon driver.
 *
 * Core of the driver: probe/remove, the inflate and deflate paths driven
 * by the device's num_pages target, balloon page migration and power
 * management.  Optional features live in stats.c, hint.c, oom.c and
 * report.c; each has a setup function that probe calls only when the
 * feature was negotiated, and a teardown that undoes it.
 */
#include <linux/delay.h>
#include <linux/jiffies.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/scatterlist.h>
#include <linux/slab.h>
#include <linux/virtio_config.h>
#include <linux/virtio_ids.h>
#include <uapi/linux/virtio_ring.h>

#include "thinvm_balloon.h"

static unsigned int retry_delay_ms = 200;
module_param(retry_delay_ms, uint, 0644);
MODULE_PARM_DESC(retry_delay_ms,
		 "Delay before retrying an inflate that could not allocate memory, or a deflate that found all pages isolated, in ms (default 200)");

static unsigned long disable_features;
module_param(disable_features, ulong, 0444);
MODULE_PARM_DESC(disable_features,
		 "Bit mask of VIRTIO_BALLOON_F_* feature bits (below 28) to refuse even if the device offers them (default 0)");

static bool ranges = true;
module_param(ranges, bool, 0444);
MODULE_PARM_DESC(ranges,
		 "Accept VIRTIO_BALLOON_F_RANGES (inflate/deflate by page ranges) when the device offers it (default Y); N keeps frame numbers, like disable_features=0x800000");

bool tb_has(const struct thinvm_balloon *tb, unsigned int fbit)
{
	return virtio_has_feature(tb->vdev, fbit);
}

/* Used-buffer callback of the inflate, deflate and reporting queues. */
void tb_vq_ack(struct virtqueue *vq)
{
	struct thinvm_balloon *tb = vq->vdev->priv;

	wake_up(&tb->acked);
}

/*
 * Wakeup events.  A config change or stats request from the host is a
 * wakeup event: the system must not suspend before the driver has
 * answered it, or the host waits for an answer from a sleeping guest.
 * tb_wake_hold() marks a request pending when it arrives; the work item
 * calls tb_wake_begin() as it starts handling it and tb_wake_end() when
 * it is done.  A request that arrives while the work item runs stays
 * pending, so the source is only released once nothing is left.
 */
static void tb_wake_hold(struct thinvm_balloon *tb, unsigned int why)
{
	unsigned long flags;

	if (!why)
		return;
	spin_lock_irqsave(&tb->wake_lock, flags);
	tb->wake_pending |= why;
	if (!tb->wake_held) {
		tb->wake_held = true;
		pm_stay_awake(&tb->vdev->dev);
	}
	spin_unlock_irqrestore(&tb->wake_lock, flags);
}

void tb_wake_begin(struct thinvm_balloon *tb, unsigned int why)
{
	spin_lock_irq(&tb->wake_lock);
	tb->wake_pending &= ~why;
	spin_unlock_irq(&tb->wake_lock);
}

void tb_wake_end(struct thinvm_balloon *tb)
{
	spin_lock_irq(&tb->wake_lock);
	if (!tb->wake_pending && tb->wake_held) {
		tb->wake_held = false;
		pm_relax(&tb->vdev->dev);
	}
	spin_unlock_irq(&tb->wake_lock);
}

/*
 * Queue @work unless the device is going away, holding the wakeup source
 * for the device request @wake (0 if none).  Callers may run in
 * interrupt context (virtqueue and config change callbacks).
 */
void tb_queue_work(struct thinvm_balloon *tb, struct workqueue_struct *wq,
		   struct work_struct *work, unsigned int wake)
{
	unsigned long flags;

	spin_lock_irqsave(&tb->stop_lock, flags);
	if (!tb->stopping) {
		tb_wake_hold(tb, wake);
		queue_work(wq, work);
	}
	spin_unlock_irqrestore(&tb->stop_lock, flags);
}

static void tb_queue_size_work(struct thinvm_balloon *tb, unsigned long delay,
			       unsigned int wake)
{
	unsigned long flags;

	spin_lock_irqsave(&tb->stop_lock, flags);
	if (!tb->stopping) {
		tb_wake_hold(tb, wake);
		mod_delayed_work(system_freezable_wq, &tb->size_work, delay);
	}
	spin_unlock_irqrestore(&tb->stop_lock, flags);
}

/* Stop queueing work and wait for what is queued or running. */
static void tb_stop_work(struct thinvm_balloon *tb)
{
	spin_lock_irq(&tb->stop_lock);
	tb->stopping = true;
	spin_unlock_irq(&tb->stop_lock);
	cancel_delayed_work_sync(&tb->size_work);
	if (tb_has(tb, VIRTIO_BALLOON_F_STATS_VQ))
		cancel_work_sync(&tb->stats_work);
	if (tb_has(tb, VIRTIO_BALLOON_F_FREE_PAGE_HINT))
		cancel_work_sync(&tb->hint_work);

	/* Cancelled work leaves nothing to answer. */
	spin_lock_irq(&tb->wake_lock);
	tb->wake_pending = 0;
	spin_unlock_irq(&tb->wake_lock);
	tb_wake_end(tb);
}

static void tb_start_work(struct thinvm_balloon *tb)
{
	spin_lock_irq(&tb->stop_lock);
	tb->stopping = false;
	spin_unlock_irq(&tb->stop_lock);
}

/*
 * The device addresses memory by 32-bit 4 KiB frame numbers, so guest
 * memory at or above 16 TiB cannot be ballooned.
 */
static bool tb_page_addressable(struct page *page)
{
	u64 last = ((u64)page_to_pfn(page) + 1) * TB_PAGES_PER_PAGE - 1;

	return last <= U32_MAX;
}

/* Write the balloon PFNs that cover @page at tb->pfns[@at...]. */
static void tb_set_pfns(struct thinvm_balloon *tb, unsigned int at,
			struct page *page)
{
	u32 first = page_to_pfn(page) * TB_PAGES_PER_PAGE;
	unsigned int i;

	BUILD_BUG_ON(PAGE_SHIFT < VIRTIO_BALLOON_PFN_SHIFT);
	BUILD_BUG_ON(TB_PAGES_PER_PAGE > TB_PFNS_PER_REQ);
	for (i = 0; i < TB_PAGES_PER_PAGE; i++)
		tb->pfns[at + i] = cpu_to_virtio32(tb->vdev, first + i);
}

/*
 * Hand @len bytes at @buf to @vq and wait until the device has consumed
 * them.  The queue is otherwise empty (tb->lock is held), so adding one
 * buffer can only fail if the device is broken.
 */
int tb_send(struct thinvm_balloon *tb, struct virtqueue *vq, void *buf,
	    unsigned int len)
{
	struct scatterlist sg;
	unsigned int used;
	int err;

	lockdep_assert_held(&tb->lock);
	sg_init_one(&sg, buf, len);
	err = virtqueue_add_outbuf(vq, &sg, 1, tb, GFP_KERNEL);
	if (WARN_ON_ONCE(err))
		return err;
	virtqueue_kick(vq);
	wait_event(tb->acked,
		   virtqueue_get_buf(vq, &used) || virtqueue_is_broken(vq));
	return 0;
}

/* Hand the first @npfns entries of tb->pfns to @vq. */
static int tb_send_pfns(struct thinvm_balloon *tb, struct virtqueue *vq,
			unsigned int npfns)
{
	return tb_send(tb, vq, tb->pfns, sizeof(tb->pfns[0]) * npfns);
}

/* Tell @vq about the single guest page @page, in either format. */
static void tb_tell_page(struct thinvm_balloon *tb, struct virtqueue *vq,
			 struct page *page)
{
	if (tb_has(tb, VIRTIO_BALLOON_F_RANGES)) {
		tb_ranges_tell_page(tb, vq, page);
		return;
	}
	tb_set_pfns(tb, 0, page);
	tb_send_pfns(tb, vq, TB_PAGES_PER_PAGE);
}

/*
 * Without DEFLATE_ON_OOM the host may keep ballooned memory for good, so
 * it stops counting as guest RAM (MemTotal shrinks).  With it, the memory
 * can come back at any time and stays accounted as used.
 */
void tb_account(struct thinvm_balloon *tb, struct page *page, long n)
{
	if (!tb_has(tb, VIRTIO_BALLOON_F_DEFLATE_ON_OOM))
		adjust_managed_page_count(page, n);
}

/* Give deflated single pages back to the guest, after the device saw them. */
void tb_release_pages(struct thinvm_balloon *tb, struct list_head *pages)
{
	struct page *page, *next;

	list_for_each_entry_safe(page, next, pages, lru) {
		list_del(&page->lru);
		tb_account(tb, page, 1);
		put_page(page);
	}
}

/*
 * Move up to @want balloon pages (at most one request's worth) from the
 * guest into the balloon.  Returns the number moved; *@stuck is set when
 * the page allocator had nothing (more) to give.
 */
static unsigned int tb_inflate(struct thinvm_balloon *tb, unsigned int want,
			       bool *stuck)
{
	unsigned int got = 0, npfns = 0;
	struct page *page;
	LIST_HEAD(pages);

	if (tb_has(tb, VIRTIO_BALLOON_F_RANGES))
		return tb_ranges_inflate(tb, want, stuck);

	want = min_t(unsigned int, want, TB_PFNS_PER_REQ);

	/*
	 * Allocate without tb->lock: allocation may trigger compaction,
	 * which may want to migrate our own balloon pages.
	 */
	while (got + TB_PAGES_PER_PAGE <= want) {
		page = balloon_page_alloc();
		if (!page) {
			tb_count(TB_ALLOC_FAILURES, 1);
			break;
		}
		if (!tb_page_addressable(page)) {
			put_page(page);
			tb_count(TB_ALLOC_FAILURES, 1);
			break;
		}
		balloon_page_push(&pages, page);
		got += TB_PAGES_PER_PAGE;
	}

	mutex_lock(&tb->lock);
	while ((page = balloon_page_pop(&pages))) {
		balloon_page_enqueue(&tb->b_dev_info, page);
		tb_set_pfns(tb, npfns, page);
		npfns += TB_PAGES_PER_PAGE;
		tb_account(tb, page, -1);
	}
	if (npfns) {
		tb_send_pfns(tb, tb->inflate_vq, npfns);
		tb->num_pages += npfns;
		tb_count(TB_INFLATE_REQUESTS, 1);
		tb_count(TB_INFLATED_TOTAL, npfns);
		tb_count(TB_INFLATED_PAGES, npfns);
	}
	mutex_unlock(&tb->lock);
	*stuck = npfns < want;
	return npfns;
}

/*
 * Give up to @want balloon pages (at most one request's worth) back to
 * the guest.  Returns the number released.  *@stuck (if not NULL) is set
 * when the balloon is empty or its remaining pages are isolated for
 * migration.  With ranges, @whole_blocks lets whole blocks take the
 * number past @want (deflate-on-OOM) rather than splitting one.
 */
unsigned int tb_deflate(struct thinvm_balloon *tb, unsigned int want,
			bool whole_blocks, bool *stuck)
{
	unsigned int npfns = 0;
	struct page *page;
	LIST_HEAD(pages);

	if (tb_has(tb, VIRTIO_BALLOON_F_RANGES))
		return tb_ranges_deflate(tb, want, whole_blocks, stuck);

	mutex_lock(&tb->lock);
	want = min3(want, (unsigned int)TB_PFNS_PER_REQ, tb->num_pages);
	while (npfns + TB_PAGES_PER_PAGE <= want) {
		page = balloon_page_dequeue(&tb->b_dev_info);
		if (!page)
			break;
		tb_set_pfns(tb, npfns, page);
		list_add(&page->lru, &pages);
		npfns += TB_PAGES_PER_PAGE;
	}
	if (!npfns)
		goto out;

	/*
	 * Tell the device before the guest touches the pages again.  The
	 * specification only requires this order when MUST_TELL_HOST was
	 * negotiated; doing it always costs nothing, because we wait for
	 * the device either way.
	 */
	tb_send_pfns(tb, tb->deflate_vq, npfns);
	tb->num_pages -= npfns;
	tb_count(TB_DEFLATE_REQUESTS, 1);
	tb_count(TB_DEFLATED_TOTAL, npfns);
	tb_count(TB_INFLATED_PAGES, -(long)npfns);

	tb_release_pages(tb, &pages);
out:
	mutex_unlock(&tb->lock);
	if (stuck)
		*stuck = npfns < want;
	return npfns;
}

/* Balloon pages the device wants us to add (> 0) or give back (< 0). */
static s64 tb_target_delta(struct thinvm_balloon *tb)
{
	u32 target;

	/* The balloon config space is little-endian even for legacy. */
	virtio_cread_le(tb->vdev, struct virtio_balloon_config, num_pages,
			&target);
	/*
	 * Round up to whole guest pages, or a target that is not a multiple
	 * of the page size would have us inflate and deflate forever.
	 */
	return (s64)ALIGN((u64)target, TB_PAGES_PER_PAGE) -
	       READ_ONCE(tb->num_pages);
}

void tb_update_actual(struct thinvm_balloon *tb)
{
	u32 actual = READ_ONCE(tb->num_pages);

	virtio_cwrite_le(tb->vdev, struct virtio_balloon_config, actual,
			 &actual);
}

/*
 * Say once when inflating runs out of memory and once when it gets going
 * again, rather than on every retry.
 */
static void tb_note_inflate_progress(struct thinvm_balloon *tb, bool ok)
{
	struct device *dev = &tb->vdev->dev;

	if (ok == !tb->inflate_stuck)
		return;
	tb->inflate_stuck = !ok;
	if (ok)
		dev_info(dev, "inflating again, %u pages in the balloon\n",
			 READ_ONCE(tb->num_pages));
	else
		dev_info(dev, "out of memory with %u pages in the balloon, retrying every %u ms\n",
			 READ_ONCE(tb->num_pages), retry_delay_ms);
}

static void tb_size_work(struct work_struct *work)
{
	struct thinvm_balloon *tb = container_of(to_delayed_work(work),
						 struct thinvm_balloon,
						 size_work);
	unsigned int want, done;
	bool stuck;
	s64 delta;

	tb_wake_begin(tb, TB_WAKE_RESIZE);
	delta = tb_target_delta(tb);
	if (!delta)
		goto out;

	/* With ranges a round is sized by the target, up to 512 MiB. */
	want = min_t(u64, abs(delta),
		     tb_has(tb, VIRTIO_BALLOON_F_RANGES) ?
		     TB_RANGE_ROUND_PAGES : TB_PFNS_PER_REQ);
	if (delta > 0) {
		done = tb_inflate(tb, want, &stuck);
		tb_note_inflate_progress(tb, !stuck);
	} else {
		done = tb_deflate(tb, want, false, &stuck);
	}
	tb_update_actual(tb);

	if (!stuck && abs(delta) > done) {
		/* More to do: stay awake and carry on at once. */
		tb_queue_size_work(tb, 0, 0);
		return;
	}
	/*
	 * Stuck for now (no free memory, or the remaining balloon pages are
	 * being migrated): retry later, and let the system suspend meanwhile.
	 */
	if (stuck)
		tb_queue_size_work(tb, msecs_to_jiffies(retry_delay_ms), 0);
out:
	tb_wake_end(tb);
}

static void tb_config_changed(struct virtio_device *vdev)
{
	struct thinvm_balloon *tb = vdev->priv;

	tb_queue_size_work(tb, 0, TB_WAKE_RESIZE);
	if (tb_has(tb, VIRTIO_BALLOON_F_FREE_PAGE_HINT))
		tb_hint_config_changed(tb);
}

/* One virtqueue the driver may ask for, in the order of the device's queues. */
struct tb_vq_want {
	bool on;			/* its feature was negotiated */
	struct thinvm_vq_desc desc;
	struct virtqueue **vq;		/* where the queue goes, NULL if off */
};

static int tb_find_vqs(struct thinvm_balloon *tb)
{
	const struct tb_vq_want want[TB_VQ_MAX] = {
		[TB_VQ_INFLATE] = { true, { "inflate", tb_vq_ack },
				    &tb->inflate_vq },
		[TB_VQ_DEFLATE] = { true, { "deflate", tb_vq_ack },
				    &tb->deflate_vq },
		[TB_VQ_STATS] = { tb_has(tb, VIRTIO_BALLOON_F_STATS_VQ),
				  { "stats", tb_stats_request },
				  &tb->stats_vq },
		[TB_VQ_HINT] = { tb_has(tb, VIRTIO_BALLOON_F_FREE_PAGE_HINT),
				 { "free_page", NULL }, &tb->hint_vq },
		[TB_VQ_REPORT] = { tb_has(tb, VIRTIO_BALLOON_F_REPORTING),
				   { "reporting", tb_vq_ack },
				   &tb->report_vq },
	};
	struct thinvm_vq_desc desc[TB_VQ_MAX];
	struct virtqueue *vqs[TB_VQ_MAX];
	unsigned int i, n = 0;
	int err;

	/*
	 * Ask only for the queues of negotiated features, with no unnamed
	 * entries in between.  The transports number the queues they create
	 * consecutively and skip unnamed entries, so the device sees the
	 * same queue indices either way.  But from 6.11 (struct
	 * virtqueue_info) virtio_pci keeps each queue's state under its
	 * array position and del_vqs() looks it up under its queue index:
	 * with a gap before a queue (reporting without hinting), deleting
	 * the queues dereferenced a NULL pointer, so rmmod was killed and
	 * the module stayed half unloaded (Debian's 6.12.95).
	 */
	for (i = 0; i < TB_VQ_MAX; i++) {
		*want[i].vq = NULL;
		if (want[i].on)
			desc[n++] = want[i].desc;
	}
	err = thinvm_find_vqs(tb->vdev, n, vqs, desc);
	if (err)
		return err;
	for (i = 0, n = 0; i < TB_VQ_MAX; i++) {
		if (want[i].on)
			*want[i].vq = vqs[n++];
	}

	/* Hinting keeps one descriptor free for its stop id. */
	if (tb->hint_vq && virtqueue_get_vring_size(tb->hint_vq) < 2) {
		dev_err(&tb->vdev->dev, "free page queue is too small\n");
		tb->vdev->config->del_vqs(tb->vdev);
		return -ENOSPC;
	}
	return 0;
}

#ifdef CONFIG_BALLOON_COMPACTION
/*
 * Called by compaction, with @page isolated from the balloon list and
 * locked, to move a balloon page out of the way: @newpage joins the
 * balloon in its place.  The device learns of the swap as an inflate of
 * @newpage followed by a deflate of @page.
 */
static int tb_migrate_page(struct balloon_dev_info *info,
			   struct page *newpage, struct page *page,
			   enum migrate_mode mode)
{
	struct thinvm_balloon *tb = container_of(info, struct thinvm_balloon,
						 b_dev_info);
	unsigned long flags;

	/*
	 * Do not wait for inflate/deflate: they may be the ones allocating
	 * memory and so running compaction.  Compaction retries later.
	 */
	if (!mutex_trylock(&tb->lock))
		return -EAGAIN;

	get_page(newpage);	/* the balloon's reference */

	/* Managed page counts are per zone. */
	if (page_zone(page) != page_zone(newpage)) {
		tb_account(tb, page, 1);
		tb_account(tb, newpage, -1);
	}

	spin_lock_irqsave(&info->pages_lock, flags);
	balloon_page_insert(info, newpage);
	info->isolated_pages--;
	__count_vm_event(BALLOON_MIGRATE);
	spin_unlock_irqrestore(&info->pages_lock, flags);

	tb_tell_page(tb, tb->inflate_vq, newpage);
	tb_tell_page(tb, tb->deflate_vq, page);
	tb_count(TB_INFLATE_REQUESTS, 1);
	tb_count(TB_DEFLATE_REQUESTS, 1);
	tb_count(TB_MIGRATED_PAGES, TB_PAGES_PER_PAGE);

	mutex_unlock(&tb->lock);

	thinvm_balloon_page_release(info, page);
	put_page(page);		/* drop the balloon's reference */
	return MIGRATEPAGE_SUCCESS;
}

static void tb_compaction_setup(struct thinvm_balloon *tb)
{
	tb->b_dev_info.migratepage = tb_migrate_page;
}
#else
static void tb_compaction_setup(struct thinvm_balloon *tb)
{
}
#endif /* CONFIG_BALLOON_COMPACTION */

/* Give every page back to the guest and tell the device. */
static void tb_empty_balloon(struct thinvm_balloon *tb)
{
	while (READ_ONCE(tb->num_pages)) {
		if (!tb_deflate(tb, READ_ONCE(tb->num_pages), false, NULL))
			msleep(20);	/* pages isolated for migration */
	}
	tb_update_actual(tb);
}

/*
 * Bring the queues up after a device reset.  Shared by probe and restore:
 * everything that needs the device before or right after DRIVER_OK.
 */
static int tb_device_up(struct thinvm_balloon *tb)
{
	int err;

	err = tb_find_vqs(tb);
	if (err)
		return err;
	if (tb_has(tb, VIRTIO_BALLOON_F_STATS_VQ)) {
		err = tb_stats_setup(tb);
		if (err)
			goto err_del_vqs;
	}
	/* poison_val must be written before DRIVER_OK. */
	if (tb_has(tb, VIRTIO_BALLOON_F_PAGE_POISON))
		tb_poison_setup(tb);
	if (tb_has(tb, VIRTIO_BALLOON_F_RANGES))
		tb_ranges_start(tb);

	virtio_device_ready(tb->vdev);

	if (tb_has(tb, VIRTIO_BALLOON_F_STATS_VQ))
		tb_stats_start(tb);
	return 0;

err_del_vqs:
	tb->vdev->config->del_vqs(tb->vdev);
	return err;
}

/* Undo tb_device_up(), returning all memory the device holds. */
static void tb_device_down(struct thinvm_balloon *tb)
{
	tb_empty_balloon(tb);
	if (tb_has(tb, VIRTIO_BALLOON_F_FREE_PAGE_HINT))
		tb_hint_release(tb, ULONG_MAX);
	virtio_reset_device(tb->vdev);
	tb->vdev->config->del_vqs(tb->vdev);
}

static int tb_probe(struct virtio_device *vdev)
{
	struct thinvm_balloon *tb;
	int err;

	if (!vdev->config->get) {
		dev_err(&vdev->dev, "config space access is not available\n");
		return -EINVAL;
	}

	tb = kzalloc(sizeof(*tb), GFP_KERNEL);
	if (!tb)
		return -ENOMEM;
	vdev->priv = tb;
	tb->vdev = vdev;
	INIT_DELAYED_WORK(&tb->size_work, tb_size_work);
	spin_lock_init(&tb->stop_lock);
	spin_lock_init(&tb->wake_lock);
	init_waitqueue_head(&tb->acked);
	mutex_init(&tb->lock);
	balloon_devinfo_init(&tb->b_dev_info);
	tb_compaction_setup(tb);

	/*
	 * Features without device interaction come first, so that the
	 * device never sees DRIVER_OK from a driver that then fails.
	 */
	if (tb_has(tb, VIRTIO_BALLOON_F_FREE_PAGE_HINT)) {
		err = tb_hint_setup(tb);
		if (err)
			goto err_free;
	}
	if (tb_has(tb, VIRTIO_BALLOON_F_DEFLATE_ON_OOM)) {
		err = tb_oom_setup(tb);
		if (err)
			goto err_hint;
	}
	if (tb_has(tb, VIRTIO_BALLOON_F_RANGES)) {
		err = tb_ranges_setup(tb);
		if (err)
			goto err_oom;
	}

	err = tb_device_up(tb);
	if (err)
		goto err_ranges;

	/*
	 * The transport's own wakeup source covers its interrupts; requests
	 * that we finish from a work item need one of our own.
	 */
	device_set_wakeup_capable(&vdev->dev, true);

	/* Optional: a failure here leaves the rest of the balloon working. */
	if (tb_has(tb, VIRTIO_BALLOON_F_REPORTING))
		tb_report_setup(tb);

	dev_info(&vdev->dev,
		 "thinvm balloon ready (features 0x%llx, %u-byte pages)\n",
		 (unsigned long long)vdev->features, (unsigned int)PAGE_SIZE);

	/* Config changes are held back until probe returns: look now. */
	if (tb_target_delta(tb))
		tb_queue_size_work(tb, 0, TB_WAKE_RESIZE);
	return 0;

err_ranges:
	if (tb_has(tb, VIRTIO_BALLOON_F_RANGES))
		tb_ranges_teardown(tb);
err_oom:
	if (tb_has(tb, VIRTIO_BALLOON_F_DEFLATE_ON_OOM))
		tb_oom_teardown(tb);
err_hint:
	if (tb_has(tb, VIRTIO_BALLOON_F_FREE_PAGE_HINT))
		tb_hint_teardown(tb);
err_free:
	vdev->priv = NULL;
	kfree(tb);
	return err;
}

static void tb_remove(struct virtio_device *vdev)
{
	struct thinvm_balloon *tb = vdev->priv;

	if (tb_has(tb, VIRTIO_BALLOON_F_REPORTING))
		tb_report_teardown(tb);
	tb_stop_work(tb);
	tb_device_down(tb);
	if (tb_has(tb, VIRTIO_BALLOON_F_RANGES))
		tb_ranges_teardown(tb);
	if (tb_has(tb, VIRTIO_BALLOON_F_DEFLATE_ON_OOM))
		tb_oom_teardown(tb);
	if (tb_has(tb, VIRTIO_BALLOON_F_FREE_PAGE_HINT))
		tb_hint_teardown(tb);
	vdev->priv = NULL;
	kfree(tb);
}

#ifdef CONFIG_PM_SLEEP
/*
 * Hibernation images must not contain a balloon: the restoring kernel
 * starts with a fresh device.  So freeze empties it; the device inflates
 * it again after restore if it still wants to.
 */
static int tb_freeze(struct virtio_device *vdev)
{
	struct thinvm_balloon *tb = vdev->priv;

	if (tb_has(tb, VIRTIO_BALLOON_F_REPORTING))
		tb_report_teardown(tb);
	tb_stop_work(tb);
	tb_device_down(tb);
	return 0;
}

static int tb_restore(struct virtio_device *vdev)
{
	struct thinvm_balloon *tb = vdev->priv;
	int err;

	if (tb_has(tb, VIRTIO_BALLOON_F_FREE_PAGE_HINT))
		tb_hint_reset(tb);
	tb_start_work(tb);
	err = tb_device_up(tb);
	if (err)
		return err;
	if (tb_has(tb, VIRTIO_BALLOON_F_REPORTING))
		tb_report_setup(tb);
	tb_update_actual(tb);
	if (tb_target_delta(tb))
		tb_queue_size_work(tb, 0, TB_WAKE_RESIZE);
	return 0;
}
#endif

/* Runs before feature negotiation completes: refuse what we must not use. */
static int tb_validate(struct virtio_device *vdev)
{
	unsigned int fbit;

	/* Only device-specific feature bits can be refused. */
	for_each_set_bit(fbit, &disable_features, VIRTIO_TRANSPORT_F_START)
		__virtio_clear_bit(vdev, fbit);
	if (!ranges)
		__virtio_clear_bit(vdev, VIRTIO_BALLOON_F_RANGES);

	/*
	 * PAGE_POISON tells the device what free pages contain.  It only
	 * means something if the guest actually fills free pages (page
	 * poisoning, or init_on_free which zeroes them).  If the guest does
	 * and the device cannot be told, reported pages could come back
	 * with other contents, so free page reporting must stay off.
	 */
	if (!want_init_on_free() && !page_poisoning_enabled_static())
		__virtio_clear_bit(vdev, VIRTIO_BALLOON_F_PAGE_POISON);
	else if (!virtio_has_feature(vdev, VIRTIO_BALLOON_F_PAGE_POISON))
		__virtio_clear_bit(vdev, VIRTIO_BALLOON_F_REPORTING);

	/*
	 * Page reporting runs with zone locks recently dropped and must not
	 * allocate descriptor tables; and the PFNs we send are guest
	 * physical frame numbers, not DMA addresses, so an IOMMU must not
	 * get in the way.
	 */
	__virtio_clear_bit(vdev, VIRTIO_RING_F_INDIRECT_DESC);
	__virtio_clear_bit(vdev, VIRTIO_F_ACCESS_PLATFORM);
	return 0;
}

static const struct virtio_device_id tb_id_table[] = {
	{ VIRTIO_ID_BALLOON, VIRTIO_DEV_ANY_ID },
	{ 0 },
};
MODULE_DEVICE_TABLE(virtio, tb_id_table);

static unsigned int tb_features[] = {
	VIRTIO_BALLOON_F_MUST_TELL_HOST,
	VIRTIO_BALLOON_F_STATS_VQ,
	VIRTIO_BALLOON_F_DEFLATE_ON_OOM,
	VIRTIO_BALLOON_F_FREE_PAGE_HINT,
	VIRTIO_BALLOON_F_PAGE_POISON,
	VIRTIO_BALLOON_F_REPORTING,
	VIRTIO_BALLOON_F_RANGES,
};

static struct virtio_driver tb_driver = {
	.feature_table = tb_features,
	.feature_table_size = ARRAY_SIZE(tb_features),
	.driver.name = KBUILD_MODNAME,
	.driver.owner = THIS_MODULE,
	.id_table = tb_id_table,
	.validate = tb_validate,
	.probe = tb_probe,
	.remove = tb_remove,
	.config_changed = tb_config_changed,
#ifdef CONFIG_PM_SLEEP
	.freeze = tb_freeze,
	.restore = tb_restore,
#endif
};

static int __init tb_init(void)
{
	int err;

	tb_debugfs_init();
	err = register_virtio_driver(&tb_driver);
	if (err)
		tb_debugfs_exit();
	return err;
}
module_init(tb_init);

static void __exit tb_exit(void)
{
	unregister_virtio_driver(&tb_driver);
	tb_debugfs_exit();
}
module_exit(tb_exit);

MODULE_DESCRIPTION("thinvm virtio memory balloon driver");
MODULE_AUTHOR("thinvm developers");
MODULE_LICENSE("GPL");
