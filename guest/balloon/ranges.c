// SPDX-License-Identifier: GPL-2.0
/*
 * thinvm_balloon: inflating and deflating by page ranges
 * (VIRTIO_BALLOON_F_RANGES, docs/protocol/balloon-ranges.md).
 *
 * Without the feature every 4 KiB page goes to the device as a frame
 * number of its own, 256 to a request, and the device discards each page
 * with a system call of its own.  With it a request carries up to 256
 * (address, length) ranges, and the driver makes the ranges long:
 *
 *  - it allocates blocks of the device's granule (range_granule_shift:
 *    2 MiB when the host backs guest memory with huge pages), falling
 *    back one order at a time down to single pages;
 *  - it merges physically adjacent blocks and pages into one range;
 *  - one round covers up to TB_RANGE_ROUND_PAGES (512 MiB) in a single
 *    request instead of 1 MiB.
 *
 * Where the memory comes from, and whether it stays movable:
 *
 *  - Order 0: balloon_page_alloc(), as without the feature.  The page
 *    joins the balloon page list and compaction may migrate it
 *    (tb_migrate_page()).  This is the only order that may reclaim.
 *  - Orders 1 and above: allocated movable, then split into order-0
 *    pages that join the balloon page list like the above, so they stay
 *    migratable page by page.  The range sent to the device still
 *    covers the whole block (a whole 2 MiB host huge page); only the
 *    guest's bookkeeping is per page.  Nothing the balloon holds stands
 *    in the way of compaction, alloc_contig_range() (gigantic hugetlb
 *    pages, CMA), memory offlining or virtio-mem unplug, and no
 *    pageblock changes its migrate type.
 *  - With the keep_whole_blocks module parameter, blocks of
 *    pageblock_order and above (2 MiB and 4 MiB on x86-64) are instead
 *    kept whole on a list of their own, and NOT movable.  That is
 *    faster, since per-page bookkeeping costs a struct page update per
 *    4 KiB each way (3.5 GiB under TCG with init_on_alloc=0: 0.21 s to
 *    inflate and 0.15 s to deflate split blocks, 0.05-0.08 s each way
 *    whole; the frame number protocol takes 2.5-3 s), but
 *    such blocks block gigantic page allocation, offlining and
 *    virtio-mem unplug of their memory while they are held, and leave
 *    their pageblocks typed unmovable after deflate.  Balloon compaction
 *    migrates single pages only, so held whole blocks cannot be moved.
 *    Off by default.
 *  - Nothing above order 0 reclaims, compacts or wakes kswapd or
 *    kcompactd (no __GFP_RECLAIM bit), and none dips into reserves: the
 *    balloon takes only large blocks that are free anyway and never
 *    makes the guest reclaim or compact to create one.
 *
 * Deflating gives back whole blocks (keep_whole_blocks) first, newest
 * first, each whole (one range), because they are the unmovable part of
 * the balloon and because the guest and the host both gain a whole huge
 * page from each.  Then single pages, newest first: pages of a split
 * block come back in descending order and merge into one range again,
 * and a whole pageblock of them goes back to the page allocator as one
 * block (tb_release_frozen()), so the movable mode pays its per-page
 * bookkeeping on the balloon list only, not in the allocator.  Only when
 * the target needs less than a whole block and no single pages are left
 * is a whole block split into single balloon pages (which stay in the
 * balloon).
 */
#include <linux/gfp.h>
#include <linux/mm.h>
#include <linux/mmzone.h>
#include <linux/pageblock-flags.h>
#include <linux/slab.h>
#include <linux/vmstat.h>

#include "thinvm_balloon.h"

/*
 * Above order 0: only memory that is free now, no reserves, no warnings.
 * Clearing __GFP_RECLAIM turns off direct reclaim and compaction and the
 * kswapd/kcompactd wakeups; __GFP_NORETRY says the same for any path
 * that would otherwise retry.
 */
#define TB_RANGE_GFP_FLAGS	(__GFP_NORETRY | __GFP_NOWARN | __GFP_NOMEMALLOC)
#define TB_WHOLE_GFP		((GFP_HIGHUSER & ~__GFP_RECLAIM) | TB_RANGE_GFP_FLAGS)
#define TB_SPLIT_GFP		((GFP_HIGHUSER_MOVABLE & ~__GFP_RECLAIM) | \
				 TB_RANGE_GFP_FLAGS)

/* Balloon (4 KiB) pages in a block of 2^@order guest pages. */
static unsigned int tb_block_pages(unsigned int order)
{
	return TB_PAGES_PER_PAGE << order;
}

static bool keep_whole_blocks;
module_param(keep_whole_blocks, bool, 0444);
MODULE_PARM_DESC(keep_whole_blocks,
		 "Keep range blocks of pageblock order and above whole and unmovable: faster, but they block gigantic pages, memory offlining and virtio-mem unplug while held (default N)");

/* Blocks of this order are kept whole and unmovable (see above). */
static bool tb_order_whole(unsigned int order)
{
	return keep_whole_blocks && order >= pageblock_order;
}

/*
 * The device ignores a range that is not inside one of its RAM regions.
 * The guest cannot see those regions, but QEMU's (DIMMs, NUMA node
 * backends) start and end on memory section boundaries in any layout
 * where the guest can use all of their memory, so no range crosses a
 * section (128 MiB on x86-64; 256 ranges still cover 32 GiB) or a node.
 */
static bool tb_same_area(u64 a, u64 b)
{
#ifdef CONFIG_SPARSEMEM
	return (a >> SECTION_SIZE_BITS) == (b >> SECTION_SIZE_BITS) &&
	       pfn_to_nid(PHYS_PFN(a)) == pfn_to_nid(PHYS_PFN(b));
#else
	return true;
#endif
}

/*
 * Add the 2^@order pages at @page to the @n ranges at @r.  The block
 * extends the last range when the two are adjacent either way round: the
 * allocator tends to hand out ascending addresses, the balloon page list
 * gives them back descending.  Returns false when the block needs a new
 * range and all are in use.
 */
static bool tb_range_add(struct virtio_balloon_range *r, unsigned int *n,
			 struct page *page, unsigned int order)
{
	u64 addr = (u64)page_to_pfn(page) << PAGE_SHIFT;
	u64 len = (u64)PAGE_SIZE << order;

	if (*n) {
		struct virtio_balloon_range *last = &r[*n - 1];
		u64 start = le64_to_cpu(last->addr);
		u64 size = le64_to_cpu(last->len);

		if (addr == start + size && tb_same_area(addr, start)) {
			last->len = cpu_to_le64(size + len);
			return true;
		}
		if (addr + len == start && tb_same_area(addr, start)) {
			last->addr = cpu_to_le64(addr);
			last->len = cpu_to_le64(size + len);
			return true;
		}
	}
	if (*n == TB_RANGES_PER_REQ)
		return false;
	r[*n].addr = cpu_to_le64(addr);
	r[*n].len = cpu_to_le64(len);
	(*n)++;
	return true;
}

/* Hand @n ranges to @vq and wait for the device to return them. */
static void tb_send_ranges(struct thinvm_balloon *tb, struct virtqueue *vq,
			   struct virtio_balloon_range *r, unsigned int n)
{
	if (tb_send(tb, vq, r, n * sizeof(*r)))
		return;
	tb_count(TB_RANGE_REQUESTS, 1);
	tb_count(TB_RANGES_SENT, n);
}

/* Tell @vq about one balloon page: compaction moving the balloon. */
void tb_ranges_tell_page(struct thinvm_balloon *tb, struct virtqueue *vq,
			 struct page *page)
{
	unsigned int n = 0;

	lockdep_assert_held(&tb->lock);
	tb_range_add(tb->ranges, &n, page, 0);
	tb_send_ranges(tb, vq, tb->ranges, n);
}

static struct page *tb_alloc_block(unsigned int order)
{
	if (!order)
		return balloon_page_alloc();
	return alloc_pages(tb_order_whole(order) ? TB_WHOLE_GFP : TB_SPLIT_GFP,
			   order);
}

static void tb_count_block(struct thinvm_balloon *tb, unsigned int order)
{
	atomic_long_inc(&tb_blocks_by_order[order]);
	tb_count(order == tb->range_order ? TB_HUGE_BLOCKS : TB_SMALL_BLOCKS,
		 1);
}

/*
 * Whole blocks are marked offline page by page, as balloon pages are, so
 * that dump tools and hibernation skip them.
 */
static void tb_set_offline(struct page *page, unsigned int order)
{
	unsigned long i;

	for (i = 0; i < BIT(order); i++)
		__SetPageOffline(page + i);
}

static void tb_clear_offline(struct page *page, unsigned int order)
{
	unsigned long i;

	for (i = 0; i < BIT(order); i++)
		__ClearPageOffline(page + i);
}

/* Put the 2^@order (split) pages at @page on the balloon page list. */
static void tb_enqueue_pages(struct thinvm_balloon *tb, struct page *page,
			     unsigned int order)
{
	LIST_HEAD(pages);
	unsigned long i;

	/* Ascending, so that the list gives them back descending. */
	for (i = 0; i < BIT(order); i++)
		list_add_tail(&page[i].lru, &pages);
	balloon_page_list_enqueue(&tb->b_dev_info, &pages);
}

/* Put a freshly allocated block in the balloon. */
static void tb_keep_block(struct thinvm_balloon *tb, struct page *page,
			  unsigned int order)
{
	lockdep_assert_held(&tb->lock);
	tb_account(tb, page, -(long)BIT(order));
	if (!tb_order_whole(order)) {
		if (order)
			split_page(page, order);
		tb_enqueue_pages(tb, page, order);
		return;
	}
	tb_set_offline(page, order);
	set_page_private(page, order);
	list_add(&page->lru, &tb->whole_blocks);
	tb->whole_pages += tb_block_pages(order);
	count_vm_events(BALLOON_INFLATE, BIT(order));
	tb_count(TB_WHOLE_BLOCKS_HELD, 1);
}

/* Give a whole block, already off the list and deflated, to the guest. */
static void tb_free_whole(struct thinvm_balloon *tb, struct page *page)
{
	unsigned int order = page_private(page);

	set_page_private(page, 0);
	tb_clear_offline(page, order);
	count_vm_events(BALLOON_DEFLATE, BIT(order));
	tb_account(tb, page, BIT(order));
	__free_pages(page, order);
}

/*
 * Turn the newest whole block into single balloon pages, so that part
 * of it can be deflated.  The pages stay in the balloon (the device is
 * not told anything) and become movable.  Returns the balloon pages
 * moved to the balloon page list.
 */
static unsigned int tb_split_whole(struct thinvm_balloon *tb)
{
	struct page *page = list_first_entry(&tb->whole_blocks, struct page,
					     lru);
	unsigned int order = page_private(page);

	list_del(&page->lru);
	set_page_private(page, 0);
	tb_clear_offline(page, order);
	/* The balloon page list counts them as inflated again. */
	count_vm_events(BALLOON_DEFLATE, BIT(order));
	split_page(page, order);
	tb_enqueue_pages(tb, page, order);
	tb->whole_pages -= tb_block_pages(order);
	tb_count(TB_WHOLE_BLOCKS_HELD, -1);
	tb_count(TB_WHOLE_BLOCKS_SPLIT, 1);
	return tb_block_pages(order);
}

/*
 * Move up to @want balloon pages (at most one request's worth) from the
 * guest into the balloon.  Returns the number moved; *@stuck is set when
 * the page allocator had nothing left even at order 0.
 */
unsigned int tb_ranges_inflate(struct thinvm_balloon *tb, unsigned int want,
			       bool *stuck)
{
	struct virtio_balloon_range *r = tb->inflate_ranges;
	unsigned int order = tb->range_order, got = 0, n = 0;
	struct page *page, *next;
	LIST_HEAD(blocks);

	*stuck = false;
	want = min(want, TB_RANGE_ROUND_PAGES);

	/*
	 * Allocate without tb->lock: an order-0 allocation may compact,
	 * which may want to migrate our own balloon pages.  Only this work
	 * item inflates, so inflate_ranges[] is ours.  Stop when all ranges
	 * are in use, so that every block allocated fits in the request.
	 */
	while (got < want && n < TB_RANGES_PER_REQ) {
		/* Never overshoot the target. */
		while (order && tb_block_pages(order) > want - got)
			order--;
		page = tb_alloc_block(order);
		if (!page) {
			if (order) {
				/* Stay below this order for the rest of the round. */
				order--;
				continue;
			}
			tb_count(TB_ALLOC_FAILURES, 1);
			*stuck = true;
			break;
		}
		tb_range_add(r, &n, page, order);	/* n < TB_RANGES_PER_REQ */
		set_page_private(page, order);
		list_add_tail(&page->lru, &blocks);
		got += tb_block_pages(order);
		tb_count_block(tb, order);
	}
	if (!got)
		return 0;

	mutex_lock(&tb->lock);
	list_for_each_entry_safe(page, next, &blocks, lru) {
		order = page_private(page);
		list_del(&page->lru);
		set_page_private(page, 0);
		tb_keep_block(tb, page, order);
	}
	tb_send_ranges(tb, tb->inflate_vq, r, n);
	tb->num_pages += got;
	tb_count(TB_INFLATE_REQUESTS, 1);
	tb_count(TB_INFLATED_TOTAL, got);
	tb_count(TB_INFLATED_PAGES, got);
	mutex_unlock(&tb->lock);
	return got;
}

/*
 * Take whole blocks off the balloon for deflating, newest first, up to
 * @want balloon pages, or until @want is reached or passed if
 * @whole_blocks.  Returns the balloon pages taken; *@full is set when the
 * request has no room left.
 */
static unsigned int tb_take_whole(struct thinvm_balloon *tb,
				  unsigned int want, bool whole_blocks,
				  struct list_head *blocks, unsigned int *n,
				  bool *full)
{
	unsigned int done = 0, size;
	struct page *page;

	while (done < want && !list_empty(&tb->whole_blocks)) {
		page = list_first_entry(&tb->whole_blocks, struct page, lru);
		size = tb_block_pages(page_private(page));
		if (done + size > want && !whole_blocks)
			break;
		if (!tb_range_add(tb->ranges, n, page, page_private(page))) {
			*full = true;
			break;
		}
		list_move_tail(&page->lru, blocks);
		tb->whole_pages -= size;
		tb_count(TB_WHOLE_BLOCKS_HELD, -1);
		done += size;
	}
	return done;
}

/*
 * Balloon pages taken per hold of the balloon's pages lock.  The lock
 * keeps interrupts off, so it is dropped after one pageblock's worth.
 */
#define TB_DEQUEUE_BATCH	512U

/*
 * A balloon page leaves the balloon for the page allocator: undo what
 * balloon_page_insert() did.  page->mapping is cleared rather than left
 * typed movable, as __ClearPageMovable() would: the page may go back as
 * the tail of a whole block (tb_release_frozen()), and the allocator
 * checks tail pages for a NULL mapping.
 */
static void tb_page_leave_balloon(struct page *page)
{
	list_del(&page->lru);
	__ClearPageOffline(page);
	page->mapping = NULL;
	set_page_private(page, 0);
}

/*
 * Take up to @max balloon pages off the balloon page list, newest first,
 * adding each to the ranges of the deflate request; *@full is set when
 * the request has no room left.  The pages go to @pages with their
 * reference count frozen at zero.
 *
 * The freeze replaces the page lock that balloon_page_list_dequeue()
 * takes, and is as safe: isolate_movable_page() takes a reference before
 * anything else, so a balloon page whose only reference is the balloon's
 * is not being isolated, and once frozen it cannot be.  A page someone
 * holds (compaction trying it, or putting it back) stays for a later
 * round.  Returns the pages taken.
 */
static unsigned int tb_dequeue_frozen(struct thinvm_balloon *tb,
				      unsigned int max,
				      struct list_head *pages,
				      unsigned int *n, bool *full)
{
	struct balloon_dev_info *info = &tb->b_dev_info;
	struct page *page, *next;
	unsigned int got = 0;
	unsigned long flags;

	spin_lock_irqsave(&info->pages_lock, flags);
	list_for_each_entry_safe(page, next, &info->pages, lru) {
		if (got == max)
			break;
		if (!page_ref_freeze(page, 1))
			continue;
		if (!tb_range_add(tb->ranges, n, page, 0)) {
			page_ref_unfreeze(page, 1);
			*full = true;
			break;
		}
		tb_page_leave_balloon(page);
		/* The list gives pages newest first: @pages gets them oldest first. */
		list_add(&page->lru, pages);
		got++;
	}
	spin_unlock_irqrestore(&info->pages_lock, flags);
	count_vm_events(BALLOON_DEFLATE, got);
	return got;
}

/*
 * Take up to @want balloon pages off the balloon page list for deflating,
 * splitting a whole block when the list has run dry.  @singles is the
 * number of balloon pages on the list or isolated from it by compaction.
 * Returns the balloon pages taken, frozen (see tb_dequeue_frozen());
 * *@isolated is set when the remaining pages are all isolated for
 * migration or held by compaction.
 */
static unsigned int tb_take_pages(struct thinvm_balloon *tb,
				  unsigned int want, unsigned int singles,
				  struct list_head *pages, unsigned int *n,
				  bool *isolated)
{
	unsigned int done = 0, max, got;
	bool full = false;

	while (!full && done + TB_PAGES_PER_PAGE <= want) {
		if (!singles) {
			if (list_empty(&tb->whole_blocks))
				break;
			singles = tb_split_whole(tb);
		}
		max = min3(want - done, singles, TB_DEQUEUE_BATCH * TB_PAGES_PER_PAGE);
		got = tb_dequeue_frozen(tb, max / TB_PAGES_PER_PAGE, pages, n,
					&full);
		if (!got) {
			*isolated = !full;
			break;
		}
		singles -= got * TB_PAGES_PER_PAGE;
		done += got * TB_PAGES_PER_PAGE;
		cond_resched();
	}
	return done;
}

/*
 * If @page and the entries after it on @pages are a naturally aligned
 * block of 2^@order pages in ascending order, within one zone, return the
 * block's last page.
 */
static struct page *tb_list_block_end(struct list_head *pages,
				      struct page *page, unsigned int order)
{
	unsigned long pfn = page_to_pfn(page), i;
	struct page *last = page;

	if (!IS_ALIGNED(pfn, BIT(order)))
		return NULL;
	for (i = 1; i < BIT(order); i++) {
		if (list_is_last(&last->lru, pages))
			return NULL;
		last = list_next_entry(last, lru);
		if (page_to_pfn(last) != pfn + i)
			return NULL;
	}
	return page_zone(last) == page_zone(page) ? last : NULL;
}

/* Free 2^@order frozen pages at @page (tail pages stay frozen at zero). */
static void tb_free_frozen(struct thinvm_balloon *tb, struct page *page,
			   unsigned int order)
{
	page_ref_unfreeze(page, 1);
	tb_account(tb, page, BIT(order));
	__free_pages(page, order);
}

/*
 * Give deflated pages (from tb_take_pages(), frozen) back to the guest,
 * after the device saw them.  Where @pages holds a whole pageblock in
 * ascending order, as deflating the pages of a split block gives them,
 * the block goes back to the page allocator in one piece, with its tail
 * pages at reference count zero like those of any unsplit high-order
 * allocation: one free instead of 512 frees that the allocator then
 * merges again, one by one.  This is what makes the default (movable)
 * mode deflate about as fast as whole blocks do.  Other pages are freed
 * one by one.
 */
static void tb_release_frozen(struct thinvm_balloon *tb,
			      struct list_head *pages)
{
	unsigned int order = pageblock_order;
	struct page *page, *last;
	LIST_HEAD(block);

	while (!list_empty(pages)) {
		page = list_first_entry(pages, struct page, lru);
		last = tb_list_block_end(pages, page, order);
		if (last) {
			list_cut_position(&block, pages, &last->lru);
			INIT_LIST_HEAD(&block);
			tb_free_frozen(tb, page, order);
			tb_count(TB_DEFLATED_BLOCKS, 1);
			continue;
		}
		list_del(&page->lru);
		tb_free_frozen(tb, page, 0);
	}
}

/*
 * Give up to @want balloon pages (at most one request's worth) back to
 * the guest; with @whole_blocks, whole blocks may take it past @want.
 * Returns the number released.  *@stuck (if not NULL) is set when
 * nothing more can be released now: the balloon is empty or the rest of
 * its pages are isolated for migration.
 */
unsigned int tb_ranges_deflate(struct thinvm_balloon *tb, unsigned int want,
			       bool whole_blocks, bool *stuck)
{
	unsigned int n = 0, done = 0, singles;
	bool full = false, isolated = false;
	struct page *page, *next;
	LIST_HEAD(blocks);
	LIST_HEAD(pages);

	mutex_lock(&tb->lock);
	want = min3(want, TB_RANGE_ROUND_PAGES, tb->num_pages);
	singles = tb->num_pages - tb->whole_pages;
	done = tb_take_whole(tb, want, whole_blocks, &blocks, &n, &full);
	if (!full && done < want)
		done += tb_take_pages(tb, want - done, singles, &pages, &n,
				      &isolated);
	if (!done)
		goto out;

	/* Tell the device before the guest touches the pages again. */
	tb_send_ranges(tb, tb->deflate_vq, tb->ranges, n);
	tb->num_pages -= done;
	tb_count(TB_DEFLATE_REQUESTS, 1);
	tb_count(TB_DEFLATED_TOTAL, done);
	tb_count(TB_INFLATED_PAGES, -(long)done);

	list_for_each_entry_safe(page, next, &blocks, lru) {
		list_del(&page->lru);
		tb_free_whole(tb, page);
	}
	tb_release_frozen(tb, &pages);
out:
	mutex_unlock(&tb->lock);
	if (stuck)
		*stuck = isolated || !done;
	return done;
}

/*
 * Read the device's granule.  Called before DRIVER_OK after every reset
 * (probe and restore), when the balloon is empty.
 */
void tb_ranges_start(struct thinvm_balloon *tb)
{
	u32 shift;

	virtio_cread_le(tb->vdev, struct thinvm_balloon_config,
			range_granule_shift, &shift);
	if (shift < 12 || shift > 30) {
		dev_warn_once(&tb->vdev->dev,
			      "range_granule_shift %u is outside 12..30, using 12\n",
			      shift);
		shift = 12;
	}
	/* A block is 2^order guest pages, no larger than the allocator's. */
	tb->range_order = min_t(unsigned int,
				shift > PAGE_SHIFT ? shift - PAGE_SHIFT : 0,
				THINVM_MAX_PAGE_ORDER);
	WRITE_ONCE(tb_range_shift_now, shift);
	WRITE_ONCE(tb_range_order_now, tb->range_order);
	dev_info(&tb->vdev->dev,
		 "ranges: device granule %u KiB, blocks of order %u (%s)\n",
		 1U << (shift - 10), tb->range_order,
		 tb_order_whole(tb->range_order) ? "kept whole" :
		 "split, movable");
}

int tb_ranges_setup(struct thinvm_balloon *tb)
{
	size_t size = TB_RANGES_PER_REQ * sizeof(struct virtio_balloon_range);

	BUILD_BUG_ON(sizeof(struct virtio_balloon_range) != 16);
	INIT_LIST_HEAD(&tb->whole_blocks);
	tb->ranges = kmalloc(size, GFP_KERNEL);
	tb->inflate_ranges = kmalloc(size, GFP_KERNEL);
	if (!tb->ranges || !tb->inflate_ranges) {
		kfree(tb->inflate_ranges);
		kfree(tb->ranges);
		return -ENOMEM;
	}
	return 0;
}

/* After the balloon has been emptied. */
void tb_ranges_teardown(struct thinvm_balloon *tb)
{
	WARN_ON(!list_empty(&tb->whole_blocks));
	WRITE_ONCE(tb_range_order_now, -1);
	WRITE_ONCE(tb_range_shift_now, -1);
	kfree(tb->inflate_ranges);
	kfree(tb->ranges);
}
