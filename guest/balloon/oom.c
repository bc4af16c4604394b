// SPDX-License-Identifier: GPL-2.0
/*
 * thinvm_balloon: deflate on OOM (VIRTIO_BALLOON_F_DEFLATE_ON_OOM).
 *
 * With this feature the device accepts that the guest takes ballooned
 * memory back when it would otherwise have to kill a process.
 *
 * Why an OOM notifier and not a shrinker: a shrinker is called during
 * ordinary reclaim, long before the guest is out of memory, whenever
 * page cache or slab is being trimmed.  Upstream used a shrinker from
 * 2018 and went back to the notifier in Linux 5.7, because the balloon
 * then deflated under the slightest pressure, often right after
 * inflating (inflating itself creates that pressure): the host could not
 * rely on the balloon holding memory, and the guest took back memory
 * that dropping some cache would have freed.  The feature is defined as
 * "deflate balloon on guest out of memory condition", which is what the
 * notifier gives: it runs only from out_of_memory(), just before a
 * victim would be chosen.
 *
 * The notifier runs with the OOM lock held and each deflate request
 * waits for the device, so one notification frees a bounded batch; the
 * OOM killer retries the allocation and calls us again if that was not
 * enough.
 */
#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/oom.h>

#include "thinvm_balloon.h"

/* Run before other OOM notifiers that free less precious memory. */
#define TB_OOM_PRIORITY		80
#define TB_OOM_PAGES_MAX	(64 * TB_PFNS_PER_REQ)

static unsigned int oom_pages = TB_PFNS_PER_REQ;
module_param(oom_pages, uint, 0644);
MODULE_PARM_DESC(oom_pages,
		 "4 KiB pages to deflate per OOM notification when the device allows deflate-on-OOM (default 256, capped at 16384)");

static int tb_oom_notify(struct notifier_block *nb, unsigned long unused,
			 void *arg)
{
	struct thinvm_balloon *tb = container_of(nb, struct thinvm_balloon,
						 oom_nb);
	unsigned int want = min_t(unsigned int, READ_ONCE(oom_pages),
				  TB_OOM_PAGES_MAX);
	unsigned long *freed = arg;
	unsigned int done = 0, n;

	while (done < want) {
		n = tb_deflate(tb, want - done, true, NULL);
		if (!n)
			break;
		done += n;
	}
	if (!done)
		return NOTIFY_OK;

	tb_update_actual(tb);
	/* The OOM killer counts guest pages. */
	*freed += done / TB_PAGES_PER_PAGE;
	tb_count(TB_OOM_DEFLATIONS, 1);
	tb_count(TB_OOM_DEFLATED_PAGES, done);
	return NOTIFY_OK;
}

int tb_oom_setup(struct thinvm_balloon *tb)
{
	tb->oom_nb.notifier_call = tb_oom_notify;
	tb->oom_nb.priority = TB_OOM_PRIORITY;
	return register_oom_notifier(&tb->oom_nb);
}

void tb_oom_teardown(struct thinvm_balloon *tb)
{
	unregister_oom_notifier(&tb->oom_nb);
}
