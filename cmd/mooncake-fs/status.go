package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"sort"
	"strings"
	"text/tabwriter"

	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

func runStatus(args []string) error {
	fl := flag.NewFlagSet("status", flag.ContinueOnError)
	asJSON := fl.Bool("json", false, "print the full status as JSON")
	if err := fl.Parse(args); err != nil {
		return err
	}
	dir, err := mountpointArg(fl.Args())
	if err != nil {
		return err
	}
	raw, err := readStatus(dir)
	if err != nil {
		return err
	}
	if *asJSON {
		os.Stdout.Write(raw)
		fmt.Println()
		return nil
	}
	var s Status
	if err := json.Unmarshal(raw, &s); err != nil {
		return fmt.Errorf("decode status: %w", err)
	}
	printStatus(&s)
	return nil
}

// readStatus fetches the daemon's status through the root's xattr.
func readStatus(dir string) ([]byte, error) {
	b, err := ioctl.ReadStatus(dir)
	if err != nil {
		return nil, fmt.Errorf("%s: not a running mooncake-fs mount (%w)", dir, err)
	}
	return b, nil
}

func pct(a, b uint64) string {
	if b == 0 {
		return "0%"
	}
	return fmt.Sprintf("%.1f%%", 100*float64(a)/float64(b))
}

func printStatus(s *Status) {
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	mem := "4 KiB pages (no hugepages)"
	if s.Memory.Hugepages {
		mem = fmt.Sprintf("hugepages (%s pages)", formatSize(s.Memory.PageSize))
	}
	ev := "off (writes fail with ENOSPC when full)"
	if s.Evict.Enabled {
		ev = fmt.Sprintf("on, %.0f%% -> %.0f%%", 100*s.Evict.High, 100*s.Evict.Low)
	}
	rows := [][2]string{
		{"mountpoint", s.Mountpoint},
		{"node", fmt.Sprintf("%s (pid %d, up %.0fs)", s.Node, s.PID, s.UptimeSeconds)},
		{"capacity", formatSize(s.Capacity)},
		{"used", fmt.Sprintf("%s (%s)", formatSize(s.Used), pct(s.Used, s.Capacity))},
		{"free", fmt.Sprintf("%s, largest range %s, fragmentation %.2f", formatSize(s.Free), formatSize(s.LargestFree), s.Fragmentation)},
		{"objects", fmt.Sprintf("%d (%d open)", s.Objects, s.OpenObjects)},
		{"metadata", fmt.Sprintf("%s of %s", formatSize(s.Metadata.Used), formatSize(s.Metadata.Limit))},
		{"heap", heapLine(s.Memory)},
		{"open files", fmt.Sprintf("%d of %d, %d of them directories", s.OpenFiles.Used, s.OpenFiles.Limit, s.OpenDirs)},
		{"memory", mem},
		{"locked", fmt.Sprintf("%s of %s", formatSize(s.Memory.LockedBytes), formatSize(s.Capacity))},
		{"cuda pinned", fmt.Sprintf("%s of %s", formatSize(s.Memory.CUDAPinned), formatSize(s.Capacity))},
		{"segments", fmt.Sprint(len(s.Segments))},
		{"cpus", fmt.Sprintf("%s (of %d)", s.Affinity, s.CPUs)},
		{"eviction", ev},
		{"evictions", fmt.Sprintf("%d (%s)", s.Evict.Evictions, formatSize(s.Evict.EvictedBytes))},
		{"commits", fmt.Sprintf("%d (%d revoked)", s.Commits, s.Revokes)},
		{"transfer", fmt.Sprintf("%s in, %s out, %.2f copies per byte", formatSize(s.Transfer.BytesWritten), formatSize(s.Transfer.BytesRead), copiesPerByte(s))},
		{"paths", pathsLine(s.Transfer.Paths)},
		{"rdma", rdmaLine(s.RDMA)},
		{"registered", fmt.Sprintf("%d buffers, %s (%d since start)", s.Registrations.Live, formatSize(uint64(s.Registrations.Bytes)), s.Registrations.Total)},
		{"clients", fmt.Sprintf("%d processes with state, %d CUDA IPC handles open for them", s.Clients.Procs, s.Clients.IPC)},
	}
	for _, r := range rows {
		fmt.Fprintf(w, "%s\t%s\n", r[0], r[1])
	}
	for _, g := range s.GPUs {
		fmt.Fprintf(w, "gpu %d\t%s %s (%s), cuda %d, %s\n", g.Index, g.Name, g.UUID, g.PCIBusID, g.Ordinal, formatSize(g.MemoryTotal))
	}
	if len(s.Memory.Warnings) > 0 {
		fmt.Fprintf(w, "warnings\t%s\n", strings.Join(s.Memory.Warnings, "; "))
	}
	w.Flush()
	if c := s.Cluster; c != nil {
		printCluster(c)
	}
}

func printCluster(c *ClusterStatus) {
	live := "live"
	if !c.Live {
		live = "NOT LIVE: " + c.LiveErr
	}
	fmt.Printf("\ncluster: etcd %s, this node at %s (%s), repairer %s\n", c.Etcd, c.Addr, live, c.Repairer)
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "NODE\tADDRESS\tCAPACITY\tUSED\tFREE\tSTATE\tUP SINCE")
	for _, n := range c.Nodes {
		state := "live"
		if !n.Live {
			state = "gone since " + n.Left.Local().Format("15:04:05")
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s (%s)\t%s\t%s\t%s\n", n.Name, n.Addr, formatSize(n.Capacity), formatSize(n.Used),
			pct(n.Used, n.Capacity), formatSize(n.Free), state, n.Started.Local().Format("2006-01-02 15:04:05"))
	}
	w.Flush()
	fmt.Printf("reservations for writers elsewhere: %d open, %d made, %d expired; holds on replaced bodies: %d here, %d elsewhere\n",
		c.Reservations, c.ReservationsMade, c.ReservationsReaped, c.Holds, c.Holding)
	if c.LostCount > 0 {
		fmt.Printf("lost objects (no surviving replica, read as EIO): %d\n", c.LostCount)
		for _, k := range c.Lost {
			fmt.Printf("  %s\n", k)
		}
	}
	if c.RepairError != "" {
		fmt.Printf("last repair failed: %s\n", c.RepairError)
	}
}

func runUmount(args []string) error {
	dir, err := mountpointArg(args)
	if err != nil {
		return err
	}
	if err := unix.Unmount(dir, 0); err != nil {
		if err == unix.EBUSY {
			return fmt.Errorf("%s: busy (files are open); close them or use umount -l", dir)
		}
		return fmt.Errorf("%s: %w", dir, err)
	}
	return nil
}

func copiesPerByte(s *Status) float64 {
	moved := s.Transfer.BytesRead + s.Transfer.BytesWritten
	if moved == 0 {
		return 0
	}
	return float64(s.Transfer.CopiedBytes) / float64(moved)
}

func rdmaLine(r RDMAStatus) string {
	switch {
	case r.State == "on" && r.Stats != nil:
		return fmt.Sprintf("%s (%s), %d peer sessions, %d served; %d work requests, %d sessions broken, %d calls over TCP",
			strings.Join(r.Devices, ","), r.Provider, r.Stats.Sessions, r.Stats.Served, r.Stats.WorkRequests, r.Stats.Broken, r.Stats.Fallbacks)
	case r.Reason != "":
		return fmt.Sprintf("%s: %s", r.State, r.Reason)
	}
	return r.State
}

// pathsLine lists the transfer paths that moved bytes, with their
// copies per byte.
func pathsLine(m map[transfer.Path]transfer.PathStats) string {
	if len(m) == 0 {
		return "-"
	}
	names := make([]string, 0, len(m))
	for p := range m {
		names = append(names, string(p))
	}
	sort.Strings(names)
	var parts []string
	for _, n := range names {
		ps := m[transfer.Path(n)]
		cpb := 0.0
		if ps.Bytes() > 0 {
			cpb = float64(ps.Copied()) / float64(ps.Bytes())
		}
		parts = append(parts, fmt.Sprintf("%s %s (%.2f copies/B)", n, formatSize(ps.Bytes()), cpb))
	}
	return strings.Join(parts, ", ")
}

// heapLine is the heap in use and the soft memory limit, if any.
func heapLine(m MemoryStatus) string {
	if m.HeapLimit <= 0 || m.HeapLimit == math.MaxInt64 {
		return formatSize(m.HeapBytes) + ", no soft limit"
	}
	return fmt.Sprintf("%s, soft limit %s", formatSize(m.HeapBytes), formatSize(uint64(m.HeapLimit)))
}
