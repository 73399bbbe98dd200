package main

// CPU placement of the daemon: --cpus LIST confines every thread of the
// daemon (FUSE readers, copy loops, the CUDA driver's helpers) to a few
// CPUs. On virtual machines whose idle vCPUs halt, a wake-up of a thread
// that slept on a long-idle vCPU costs tens of microseconds; with the
// daemon's threads kept on one or two CPUs, the thread that takes the next
// request sleeps on a CPU that was busy a moment ago. The price: the
// daemon's CPU copies share those CPUs.

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// parseCPUList reads a Linux CPU list ("3", "2,3", "0-3,8") into sorted,
// distinct CPU numbers.
func parseCPUList(s string) ([]int, error) {
	if strings.TrimSpace(s) == "" {
		return nil, errors.New("empty CPU list")
	}
	var cpus []int
	for part := range strings.SplitSeq(s, ",") {
		part = strings.TrimSpace(part)
		lo, hi, isRange := strings.Cut(part, "-")
		a, err := strconv.Atoi(lo)
		if err != nil || a < 0 {
			return nil, fmt.Errorf("CPU list %q: bad entry %q", s, part)
		}
		b := a
		if isRange {
			if b, err = strconv.Atoi(hi); err != nil || b < a {
				return nil, fmt.Errorf("CPU list %q: bad range %q", s, part)
			}
		}
		if b >= 1<<16 {
			return nil, fmt.Errorf("CPU list %q: CPU %d out of range", s, b)
		}
		for c := a; c <= b; c++ {
			cpus = append(cpus, c)
		}
	}
	slices.Sort(cpus)
	return slices.Compact(cpus), nil
}

// formatCPUList writes cpus back as a compact list ("0-3,8").
func formatCPUList(cpus []int) string {
	var b strings.Builder
	for i := 0; i < len(cpus); {
		j := i
		for j+1 < len(cpus) && cpus[j+1] == cpus[j]+1 {
			j++
		}
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		if j == i {
			fmt.Fprintf(&b, "%d", cpus[i])
		} else {
			fmt.Fprintf(&b, "%d-%d", cpus[i], cpus[j])
		}
		i = j + 1
	}
	return b.String()
}

// allowedCPUs returns the CPUs this thread may run on.
func allowedCPUs() ([]int, error) {
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		return nil, err
	}
	var cpus []int
	for c := 0; c < len(set)*64; c++ {
		if set.IsSet(c) {
			cpus = append(cpus, c)
		}
	}
	return cpus, nil
}

// confineToCPUs restricts every thread of the process to cpus, which must
// all be allowed now, and sets GOMAXPROCS to their number. Threads created
// later inherit the mask of their creator. It changes nothing when a CPU
// is not allowed.
func confineToCPUs(cpus []int) error {
	allowed, err := allowedCPUs()
	if err != nil {
		return fmt.Errorf("read CPU affinity: %w", err)
	}
	var set unix.CPUSet
	for _, c := range cpus {
		if !slices.Contains(allowed, c) {
			return fmt.Errorf("CPU %d is not available to this process (allowed: %s)", c, formatCPUList(allowed))
		}
		set.Set(c)
	}
	// Twice: a thread started while the first pass ran may have copied
	// the old mask from a thread not yet done.
	for range 2 {
		tasks, err := os.ReadDir("/proc/self/task")
		if err != nil {
			return fmt.Errorf("list threads: %w", err)
		}
		for _, t := range tasks {
			tid, err := strconv.Atoi(t.Name())
			if err != nil {
				continue
			}
			if err := unix.SchedSetaffinity(tid, &set); err != nil && !errors.Is(err, unix.ESRCH) {
				return fmt.Errorf("set CPU affinity of thread %d: %w", tid, err)
			}
		}
	}
	runtime.GOMAXPROCS(len(cpus))
	return nil
}
