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
 */
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/poison.h>
#include <linux/scatterlist.h>
#include <linux/string.h>

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
	dev_info(dev, "free page reporting on, order %d\n",
		 READ_ONCE(tb_report_order_now));
}

void tb_report_teardown(struct thinvm_balloon *tb)
{
	if (!tb->reporting)
		return;
	page_reporting_unregister(&tb->pr_dev_info);
	tb->reporting = false;
	WRITE_ONCE(tb_report_order_now, -1);
}
