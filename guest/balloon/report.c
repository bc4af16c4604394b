// SPDX-License-Identifier: GPL-2.0
/*
 * thinvm_balloon: free page reporting (VIRTIO_BALLOON_F_REPORTING) and
 * the page poison value it depends on (VIRTIO_BALLOON_F_PAGE_POISON).
 *
 * Page reporting is driven by mm/page_reporting.c: every couple of
 * seconds it pulls free buddy blocks of at least the reporting order off
 * the free lists, hands them to us in a scatterlist, and puts them back
 * when we return.  We pass them to the device, which may discard their
 * backing memory; the next guest access then faults in a fresh page.
 *
 * A fresh page from the device is zero-filled unless the device was told
 * otherwise.  If the guest poisons free pages (page_poison=1) or zeroes
 * them (init_on_free=1) it checks or relies on that content, so the
 * device must either reproduce it or not discard: that is what
 * poison_val tells it.  tb_validate() refuses reporting when the guest
 * fills free pages and the device does not offer PAGE_POISON.
 *
 * report_now, an attribute of the virtio device, lets the guest agent have
 * what a trim just freed reported at once rather than at the kernel's
 * pace (see report_now_store()).
 */
#include <linux/device.h>
#include <linux/jiffies.h>
#include <linux/kstrtox.h>
#include <linux/mm.h>
#include <linux/mutex.h>
#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/poison.h>
#include <linux/scatterlist.h>
#include <linux/string.h>
#include <linux/workqueue.h>

#include "thinvm_balloon.h"

static unsigned int report_order;
module_param(report_order, uint, 0444);
MODULE_PARM_DESC(report_order,
		 "Smallest buddy order reported as free to the host; 0 (default) means pageblock_order (2 MiB on x86-64). From Linux 6.2 the kernel-wide page_reporting.page_reporting_order wins once set, by boot parameter or by the first registration since boot");

/*
 * Before DRIVER_OK: tell the device what free pages contain.  0 stands
 * for init_on_free (zeroed), otherwise each byte is PAGE_POISON.  The
 * field is little-endian; the pattern is the same byte repeated, so no
 * swapping is needed.
 */
void tb_poison_setup(struct thinvm_balloon *tb)
{
	u32 poison = 0;

	if (!want_init_on_free())
		memset(&poison, PAGE_POISON, sizeof(poison));
	virtio_cwrite_le(tb->vdev, struct virtio_balloon_config, poison_val,
			 &poison);
}

static int tb_report(struct page_reporting_dev_info *pr,
		     struct scatterlist *sgl, unsigned int nents)
{
	struct thinvm_balloon *tb = container_of(pr, struct thinvm_balloon,
						 pr_dev_info);
	struct virtqueue *vq = tb->report_vq;
	struct scatterlist *sg;
	unsigned long bytes = 0;
	unsigned int len, i;
	int err;

	/*
	 * The queue is empty (one report at a time) and at least
	 * PAGE_REPORTING_CAPACITY long without indirect descriptors, so
	 * this cannot fail short of a broken device.  Failing only leaves
	 * the pages unreported.
	 */
	err = virtqueue_add_inbuf(vq, sgl, nents, tb, GFP_NOWAIT | __GFP_NOWARN);
	if (WARN_ON_ONCE(err))
		return err;
	virtqueue_kick(vq);
	wait_event(tb->acked,
		   virtqueue_get_buf(vq, &len) || virtqueue_is_broken(vq));

	for_each_sg(sgl, sg, nents, i)
		bytes += sg->length;
	tb_count(TB_REPORT_REQUESTS, 1);
	tb_count(TB_REPORT_PAGES, bytes >> VIRTIO_BALLOON_PFN_SHIFT);
	return 0;
}

/*
 * A report_now write runs at most this many passes, for at most this
 * long: a pass that reports nothing ends it earlier.
 */
#define TB_REPORT_NOW_PASSES_MAX	256
#define TB_REPORT_NOW_TIMEOUT		(10 * HZ)

/* One report_now writer at a time (there is normally one device). */
static DEFINE_MUTEX(tb_report_now_lock);

/*
 * Report what is free now, pass after pass, until a pass finds nothing.
 *
 * mm/page_reporting.c starts a pass at most every 2 s (PAGE_REPORTING_DELAY)
 * and takes only about a sixteenth of each free list per pass (its budget),
 * re-arming itself for the rest: "all pages on an idle system in about 30
 * seconds".  That pace suits memory freed in passing; a trim frees
 * gigabytes at once and its caller waits for the host to get them: ~1.7 GiB
 * took 8-11 s more than the reclaim itself.
 * The work item that runs a pass is the one page_reporting_register() set
 * up in our page_reporting_dev_info; running it at once does here what its
 * re-arming would do 2 s later.  Pages are taken off the free lists only by
 * the pass itself, as always.
 */
static ssize_t report_now_store(struct device *dev,
				struct device_attribute *attr,
				const char *buf, size_t count)
{
	struct thinvm_balloon *tb = dev_to_virtio(dev)->priv;
	unsigned long deadline = jiffies + TB_REPORT_NOW_TIMEOUT;
	long before;
	bool now;
	int pass;
	int err;

	err = kstrtobool(buf, &now);
	if (err)
		return err;
	if (!now)
		return count;

	mutex_lock(&tb_report_now_lock);
	tb_count(TB_REPORT_NOW_RUNS, 1);
	for (pass = 0; pass < TB_REPORT_NOW_PASSES_MAX; pass++) {
		before = atomic_long_read(&tb_counters[TB_REPORT_PAGES]);
		mod_delayed_work(system_wq, &tb->pr_dev_info.work, 0);
		flush_delayed_work(&tb->pr_dev_info.work);
		tb_count(TB_REPORT_NOW_PASSES, 1);
		if (atomic_long_read(&tb_counters[TB_REPORT_PAGES]) == before ||
		    time_after(jiffies, deadline) || signal_pending(current))
			break;
		cond_resched();
	}
	mutex_unlock(&tb_report_now_lock);
	return count;
}
static DEVICE_ATTR_WO(report_now);

/*
 * After DRIVER_OK, since reports may start at once.  A failure here is
 * not fatal: the balloon works without reporting, for instance while
 * another driver (there can be only one) has reporting registered.
 */
void tb_report_setup(struct thinvm_balloon *tb)
{
	struct device *dev = &tb->vdev->dev;
	unsigned int order = report_order;
	int err;

	if (virtqueue_get_vring_size(tb->report_vq) < PAGE_REPORTING_CAPACITY) {
		dev_warn(dev, "reporting queue too small, page reporting off\n");
		return;
	}
	if (order > THINVM_MAX_PAGE_ORDER) {
		dev_warn(dev, "report_order %u is above %u, using pageblock_order\n",
			 order, THINVM_MAX_PAGE_ORDER);
		order = 0;
	}

	tb->pr_dev_info.report = tb_report;
	tb->pr_dev_info.order = order ? order : pageblock_order;
	err = page_reporting_register(&tb->pr_dev_info);
	if (err) {
		dev_warn(dev, "cannot register for free page reporting (%d), page reporting off\n",
			 err);
		return;
	}
	tb->reporting = true;
	WRITE_ONCE(tb_report_order_now,
		   thinvm_reporting_order(&tb->pr_dev_info));
	/* Optional too: without it reports come at the kernel's pace. */
	if (device_create_file(dev, &dev_attr_report_now))
		dev_warn(dev, "cannot create report_now\n");
	dev_info(dev, "free page reporting on, order %d\n",
		 READ_ONCE(tb_report_order_now));
}

void tb_report_teardown(struct thinvm_balloon *tb)
{
	if (!tb->reporting)
		return;
	/* Waits for a report_now write in progress, so none is left after. */
	device_remove_file(&tb->vdev->dev, &dev_attr_report_now);
	page_reporting_unregister(&tb->pr_dev_info);
	tb->reporting = false;
	WRITE_ONCE(tb_report_order_now, -1);
}
