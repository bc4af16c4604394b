/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Kernel API differences that thinvm_balloon has to paper over.
 *
 * Everything that depends on LINUX_VERSION_CODE lives in this file so the
 * driver proper reads as if it were written for a single kernel.  The
 * supported range is 6.1 (Debian 12) to 6.12 (Debian 12 backports); both
 * are built by build.sh.
 *
 * Things that did NOT change across that range, checked against both
 * header trees, and so need no shim here:
 *  - struct balloon_dev_info, balloon_page_alloc/enqueue/dequeue and the
 *    migratepage callback signature (movable_operations since 6.0, page
 *    based, returns MIGRATEPAGE_SUCCESS), but not how a migrated page
 *    leaves the balloon: see thinvm_balloon_page_release();
 *  - struct page_reporting_dev_info (with .order);
 *  - register_oom_notifier(), virtio_cread_le()/virtio_cwrite_le(),
 *    virtio_reset_device().
 */
#ifndef THINVM_BALLOON_COMPAT_H
#define THINVM_BALLOON_COMPAT_H

#include <linux/version.h>
#include <linux/mmzone.h>
#include <linux/page_reporting.h>
#include <linux/shrinker.h>
#include <linux/slab.h>
#include <linux/virtio_config.h>
#include <linux/virtio_balloon.h>

#if LINUX_VERSION_CODE < KERNEL_VERSION(6, 1, 0)
#error "thinvm_balloon needs Linux 6.1 or newer"
#endif

/*
 * Highest buddy allocator order.  Before 6.4 MAX_ORDER was exclusive;
 * 6.4 made it inclusive and 6.8 renamed it MAX_PAGE_ORDER.
 */
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 8, 0)
#define THINVM_MAX_PAGE_ORDER	MAX_PAGE_ORDER
#elif LINUX_VERSION_CODE >= KERNEL_VERSION(6, 4, 0)
#define THINVM_MAX_PAGE_ORDER	MAX_ORDER
#else
#define THINVM_MAX_PAGE_ORDER	(MAX_ORDER - 1)
#endif

/*
 * Statistics tags 10..15 entered the uapi header in 6.10 (OOM kills,
 * allocation stalls) and 6.12 (scan/reclaim).  The counters behind them
 * exist in every supported kernel, so older headers just get the numbers
 * (they are fixed by the virtio specification).  Tested with #ifndef
 * rather than the version so that distribution backports of the uapi
 * header do not clash.
 */
#ifndef VIRTIO_BALLOON_S_OOM_KILL
#define VIRTIO_BALLOON_S_OOM_KILL	10
#define VIRTIO_BALLOON_S_ALLOC_STALL	11
#endif
#ifndef VIRTIO_BALLOON_S_ASYNC_SCAN
#define VIRTIO_BALLOON_S_ASYNC_SCAN	12
#define VIRTIO_BALLOON_S_DIRECT_SCAN	13
#define VIRTIO_BALLOON_S_ASYNC_RECLAIM	14
#define VIRTIO_BALLOON_S_DIRECT_RECLAIM	15
#endif
/* Number of tags this driver knows how to fill. */
#define THINVM_BALLOON_S_MAX		16

/*
 * Virtqueue discovery.  6.11 replaced the parallel callbacks[]/names[]
 * arrays of virtio_find_vqs() with an array of struct virtqueue_info.
 * A NULL name means "this queue does not exist" in both APIs, but
 * tb_find_vqs() passes none: virtio_pci in 6.11 to 6.12.95 at least
 * mishandles them when it deletes the queues (see there).
 */
struct thinvm_vq_desc {
	const char *name;
	vq_callback_t *callback;
};

#define THINVM_MAX_VQS	5

static inline int thinvm_find_vqs(struct virtio_device *vdev,
				  unsigned int nvqs, struct virtqueue *vqs[],
				  const struct thinvm_vq_desc *desc)
{
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 11, 0)
	struct virtqueue_info info[THINVM_MAX_VQS] = {};
	unsigned int i;

	if (WARN_ON(nvqs > THINVM_MAX_VQS))
		return -EINVAL;
	for (i = 0; i < nvqs; i++) {
		info[i].name = desc[i].name;
		info[i].callback = desc[i].callback;
	}
	return virtio_find_vqs(vdev, nvqs, vqs, info, NULL);
#else
	vq_callback_t *callbacks[THINVM_MAX_VQS];
	const char *names[THINVM_MAX_VQS];
	unsigned int i;

	if (WARN_ON(nvqs > THINVM_MAX_VQS))
		return -EINVAL;
	for (i = 0; i < nvqs; i++) {
		names[i] = desc[i].name;
		callbacks[i] = desc[i].callback;
	}
	return virtio_find_vqs(vdev, nvqs, vqs, callbacks, names, NULL);
#endif
}

/*
 * Shrinkers.  6.7 turned them into objects allocated by the core
 * (shrinker_alloc()/shrinker_register()/shrinker_free(), with a
 * private_data pointer); before that the caller embedded a struct shrinker
 * and called register_shrinker(), which takes a name since 6.0.
 * thinvm_shrinker_create() returns NULL on failure.
 */
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 7, 0)
static inline struct shrinker *
thinvm_shrinker_create(const char *name,
		       unsigned long (*count)(struct shrinker *,
					      struct shrink_control *),
		       unsigned long (*scan)(struct shrinker *,
					     struct shrink_control *),
		       void *priv)
{
	struct shrinker *s = shrinker_alloc(0, "%s", name);

	if (!s)
		return NULL;
	s->count_objects = count;
	s->scan_objects = scan;
	s->seeks = DEFAULT_SEEKS;
	s->private_data = priv;
	shrinker_register(s);
	return s;
}

static inline void thinvm_shrinker_destroy(struct shrinker *s)
{
	shrinker_free(s);
}

static inline void *thinvm_shrinker_priv(struct shrinker *s)
{
	return s->private_data;
}
#else
struct thinvm_shrinker_box {
	struct shrinker shrinker;
	void *priv;
};

static inline struct shrinker *
thinvm_shrinker_create(const char *name,
		       unsigned long (*count)(struct shrinker *,
					      struct shrink_control *),
		       unsigned long (*scan)(struct shrinker *,
					     struct shrink_control *),
		       void *priv)
{
	struct thinvm_shrinker_box *box = kzalloc(sizeof(*box), GFP_KERNEL);

	if (!box)
		return NULL;
	box->shrinker.count_objects = count;
	box->shrinker.scan_objects = scan;
	box->shrinker.seeks = DEFAULT_SEEKS;
	box->priv = priv;
	if (register_shrinker(&box->shrinker, "%s", name)) {
		kfree(box);
		return NULL;
	}
	return &box->shrinker;
}

static inline void thinvm_shrinker_destroy(struct shrinker *s)
{
	unregister_shrinker(s);
	kfree(container_of(s, struct thinvm_shrinker_box, shrinker));
}

static inline void *thinvm_shrinker_priv(struct shrinker *s)
{
	return container_of(s, struct thinvm_shrinker_box, shrinker)->priv;
}
#endif

/*
 * The order the page reporting core actually uses.  Up to 6.1 it is the
 * driver's .order, or pageblock_order when that is 0.  From 6.2 the core
 * keeps it in the exported (but undeclared) page_reporting_order: the
 * page_reporting.page_reporting_order parameter may set it at boot or at
 * run time, and otherwise the first registration since boot sets it from
 * its .order; later registrations do not change it.
 */
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 2, 0)
extern unsigned int page_reporting_order;

static inline unsigned int
thinvm_reporting_order(const struct page_reporting_dev_info *pr)
{
	return READ_ONCE(page_reporting_order);
}
#else
static inline unsigned int
thinvm_reporting_order(const struct page_reporting_dev_info *pr)
{
	return pr->order ? pr->order : pageblock_order;
}
#endif

/*
 * The old page of a balloon page migration leaves the balloon.  Kernels
 * with the 2025 movable-ops rework (in 6.1.y and 6.12.y only since a
 * January 2026 stable backport, hence detected from the headers by the
 * Makefile, not by version) have balloon_page_finalize().  Before it,
 * virtio_balloon took the page out with balloon_page_delete() under the
 * pages lock; the backport removed that helper, so its body is spelled
 * out here (the page is isolated, so the list is not touched), which
 * also lets the fallback be compiled against new headers.
 */
#include <linux/balloon_compaction.h>

#ifdef THINVM_HAVE_BALLOON_PAGE_FINALIZE
static inline void thinvm_balloon_page_release(struct balloon_dev_info *info,
					       struct page *page)
{
	balloon_page_finalize(page);
}
#else
static inline void thinvm_balloon_page_release(struct balloon_dev_info *info,
					       struct page *page)
{
	unsigned long flags;

	/* balloon_page_delete() without the list_del() an isolated page skips */
	spin_lock_irqsave(&info->pages_lock, flags);
	__ClearPageOffline(page);
	__ClearPageMovable(page);
	set_page_private(page, 0);
	spin_unlock_irqrestore(&info->pages_lock, flags);
}
#endif

#endif /* THINVM_BALLOON_COMPAT_H */
