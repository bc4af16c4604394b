// SPDX-License-Identifier: GPL-2.0
/*
 * thinvm_balloon: counters for users and tests.
 *
 * Module-wide (summed over balloon devices; there is normally one), and
 * readable two ways:
 *  - /sys/kernel/debug/thinvm_balloon/stats, one "name value" per line;
 *  - /sys/module/thinvm_balloon/parameters/<name>, read-only, for systems
 *    without debugfs mounted.
 * Page counts are in 4 KiB units, the device's page size.
 */
#include <linux/debugfs.h>
#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/seq_file.h>

#include "thinvm_balloon.h"

atomic_long_t tb_counters[TB_NR_COUNTERS];
atomic_long_t tb_blocks_by_order[THINVM_MAX_PAGE_ORDER + 1];
int tb_report_order_now = -1;
int tb_range_shift_now = -1;
int tb_range_order_now = -1;

static const char * const tb_counter_names[TB_NR_COUNTERS] = {
	[TB_INFLATED_PAGES] = "inflated_pages",
	[TB_INFLATED_TOTAL] = "inflated_total",
	[TB_DEFLATED_TOTAL] = "deflated_total",
	[TB_INFLATE_REQUESTS] = "inflate_requests",
	[TB_DEFLATE_REQUESTS] = "deflate_requests",
	[TB_ALLOC_FAILURES] = "alloc_failures",
	[TB_OOM_DEFLATIONS] = "oom_deflations",
	[TB_OOM_DEFLATED_PAGES] = "oom_deflated_pages",
	[TB_MIGRATED_PAGES] = "migrated_pages",
	[TB_STATS_UPDATES] = "stats_updates",
	[TB_HINT_RUNS] = "hint_runs",
	[TB_HINT_BLOCKS] = "hint_blocks",
	[TB_HINT_BLOCKS_HELD] = "hint_blocks_held",
	[TB_HINT_BLOCKS_SHRUNK] = "hint_blocks_shrunk",
	[TB_REPORT_REQUESTS] = "report_requests",
	[TB_REPORT_PAGES] = "report_pages",
	[TB_RANGE_REQUESTS] = "range_requests",
	[TB_RANGES_SENT] = "ranges_sent",
	[TB_HUGE_BLOCKS] = "huge_blocks",
	[TB_SMALL_BLOCKS] = "small_blocks",
	[TB_WHOLE_BLOCKS_HELD] = "whole_blocks_held",
	[TB_WHOLE_BLOCKS_SPLIT] = "whole_blocks_split",
	[TB_DEFLATED_BLOCKS] = "deflated_blocks",
	[TB_REPORT_NOW_RUNS] = "report_now_runs",
	[TB_REPORT_NOW_PASSES] = "report_now_passes",
};

static struct dentry *tb_debugfs_dir;

static int tb_stats_show(struct seq_file *m, void *unused)
{
	int i;

	for (i = 0; i < TB_NR_COUNTERS; i++)
		seq_printf(m, "%s %ld\n", tb_counter_names[i],
			   atomic_long_read(&tb_counters[i]));
	seq_printf(m, "hint_order %u\n", TB_HINT_ORDER);
	seq_printf(m, "report_order %d\n", READ_ONCE(tb_report_order_now));
	seq_printf(m, "range_granule_shift %d\n",
		   READ_ONCE(tb_range_shift_now));
	seq_printf(m, "range_order %d\n", READ_ONCE(tb_range_order_now));
	for (i = 0; i <= THINVM_MAX_PAGE_ORDER; i++)
		seq_printf(m, "blocks_order_%d %ld\n", i,
			   atomic_long_read(&tb_blocks_by_order[i]));
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(tb_stats);

void tb_debugfs_init(void)
{
	/* debugfs is best effort: its functions cope with error pointers. */
	tb_debugfs_dir = debugfs_create_dir(KBUILD_MODNAME, NULL);
	debugfs_create_file("stats", 0444, tb_debugfs_dir, NULL,
			    &tb_stats_fops);
}

void tb_debugfs_exit(void)
{
	debugfs_remove_recursive(tb_debugfs_dir);
}

static int tb_counter_get(char *buf, const struct kernel_param *kp)
{
	return sysfs_emit(buf, "%ld\n", atomic_long_read(kp->arg));
}

static const struct kernel_param_ops tb_counter_ops = {
	.get = tb_counter_get,
};

#define TB_COUNTER_PARAM(name, idx, desc)				\
	module_param_cb(name, &tb_counter_ops, &tb_counters[idx], 0444); \
	MODULE_PARM_DESC(name, "(read-only counter) " desc)

TB_COUNTER_PARAM(inflated_pages, TB_INFLATED_PAGES,
		 "4 KiB pages in the balloon now");
TB_COUNTER_PARAM(inflated_total, TB_INFLATED_TOTAL,
		 "4 KiB pages ever inflated");
TB_COUNTER_PARAM(deflated_total, TB_DEFLATED_TOTAL,
		 "4 KiB pages ever deflated, OOM deflations included");
TB_COUNTER_PARAM(inflate_requests, TB_INFLATE_REQUESTS,
		 "inflate requests sent to the device");
TB_COUNTER_PARAM(deflate_requests, TB_DEFLATE_REQUESTS,
		 "deflate requests sent to the device");
TB_COUNTER_PARAM(alloc_failures, TB_ALLOC_FAILURES,
		 "inflate attempts that found no free memory");
TB_COUNTER_PARAM(oom_deflations, TB_OOM_DEFLATIONS,
		 "OOM notifications that deflated the balloon");
TB_COUNTER_PARAM(oom_deflated_pages, TB_OOM_DEFLATED_PAGES,
		 "4 KiB pages deflated on OOM");
TB_COUNTER_PARAM(migrated_pages, TB_MIGRATED_PAGES,
		 "4 KiB balloon pages moved by compaction");
TB_COUNTER_PARAM(stats_updates, TB_STATS_UPDATES,
		 "statistics buffers sent to the device");
TB_COUNTER_PARAM(hint_runs, TB_HINT_RUNS,
		 "free page hinting runs started by the device");
TB_COUNTER_PARAM(hint_blocks, TB_HINT_BLOCKS,
		 "free page blocks hinted to the device");
TB_COUNTER_PARAM(hint_blocks_held, TB_HINT_BLOCKS_HELD,
		 "hinted blocks held now, waiting for the device to finish");
TB_COUNTER_PARAM(hint_blocks_shrunk, TB_HINT_BLOCKS_SHRUNK,
		 "hinted blocks given back early under memory pressure");
TB_COUNTER_PARAM(report_requests, TB_REPORT_REQUESTS,
		 "free page reports sent to the device");
TB_COUNTER_PARAM(report_pages, TB_REPORT_PAGES,
		 "4 KiB pages reported free to the device");
TB_COUNTER_PARAM(range_requests, TB_RANGE_REQUESTS,
		 "inflate/deflate requests sent as page ranges (VIRTIO_BALLOON_F_RANGES)");
TB_COUNTER_PARAM(ranges_sent, TB_RANGES_SENT,
		 "page ranges sent in those requests");
TB_COUNTER_PARAM(huge_blocks, TB_HUGE_BLOCKS,
		 "blocks inflated at the device's preferred order (range mode)");
TB_COUNTER_PARAM(small_blocks, TB_SMALL_BLOCKS,
		 "blocks inflated below the preferred order, single pages included (range mode)");
TB_COUNTER_PARAM(whole_blocks_held, TB_WHOLE_BLOCKS_HELD,
		 "blocks of at least pageblock_order held whole (unmovable) now");
TB_COUNTER_PARAM(whole_blocks_split, TB_WHOLE_BLOCKS_SPLIT,
		 "whole blocks split into single balloon pages to deflate part of one");
TB_COUNTER_PARAM(deflated_blocks, TB_DEFLATED_BLOCKS,
		 "pageblocks deflated and freed whole, not page by page (range mode)");
TB_COUNTER_PARAM(report_now_runs, TB_REPORT_NOW_RUNS,
		 "writes to the device's report_now attribute");
TB_COUNTER_PARAM(report_now_passes, TB_REPORT_NOW_PASSES,
		 "reporting passes run at once for report_now");
