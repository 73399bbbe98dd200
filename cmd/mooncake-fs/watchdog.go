package main

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The watchdog ends the mount's FUSE connection when the daemon dies
// without closing it.
//
// A daemon killed (kill -9, the OOM killer) normally closes /dev/fuse as
// it exits, and the kernel then fails every request of the mount with
// ENOTCONN. But a thread that is inside the kernel telling it to forget a
// name (an entry invalidation, which the cluster's index watch and the
// puts by name send) waits there, unkillably, for the directory's lock,
// and that lock may be held by a request of the same mount waiting for
// the daemon's answer. Killed then, the daemon never finishes exiting,
// /dev/fuse stays open, and the request, its caller and the mount wait
// for ever. The watchdog, a process of its own session started once the
// mount is up, sees the daemon die (gone, or a zombie) and, if its mount
// (that device at that path) outlives it by abortGrace, aborts the
// connection through fusectl, as
// `echo 1 > /sys/fs/fuse/connections/N/abort` does: the requests fail,
// the lock is let go, and the daemon's last thread exits.

const (
	watchdogCmd = "_watchdog"
	fusectlDir  = "/sys/fs/fuse/connections"
	watchEvery  = 250 * time.Millisecond
	abortGrace  = 2 * time.Second
)

// startWatchdog starts the watchdog of the mount at dir, served by this
// process; a daemon that is not root has none (fusectl's abort is
// root's).
func startWatchdog(dir string) error {
	if os.Geteuid() != 0 {
		return nil
	}
	dev, err := deviceOf(dir)
	if err != nil {
		return err
	}
	if err := mountFusectl(); err != nil {
		return err
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	start, err := startTime(os.Getpid())
	if err != nil {
		return err
	}
	abs, err := filepath.Abs(dir)
	if err == nil {
		abs, err = filepath.EvalSymlinks(abs) // as mountinfo writes it
	}
	if err != nil {
		return err
	}
	cmd := exec.Command(exe, watchdogCmd, strconv.Itoa(os.Getpid()), strconv.FormatUint(start, 10), dev, abs)
	// Its own session: a signal to the daemon's group (Ctrl-C) is not
	// its, and it outlives the daemon.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return err
	}
	go func() { _ = cmd.Wait() }() // reaped if it ends first
	return nil
}

// deviceOf is the device of the mount at dir, as mountinfo writes it
// (MAJOR:MINOR); the minor number names its FUSE connection.
func deviceOf(dir string) (string, error) {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return "", err
	}
	return fmt.Sprintf("%d:%d", unix.Major(st.Dev), unix.Minor(st.Dev)), nil
}

// stillMounted says whether mountinfo still has device dev at dir: once
// the daemon unmounted, its connection's number may be another mount's,
// which must not be aborted.
func stillMounted(dev, dir string) bool {
	info, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return false
	}
	for line := range bytes.SplitSeq(info, []byte("\n")) {
		f := bytes.Fields(line)
		if len(f) > 4 && string(f[2]) == dev && string(f[4]) == dir {
			return true
		}
	}
	return false
}

// mountFusectl mounts the FUSE control file system where it is not yet.
func mountFusectl() error {
	info, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	if bytes.Contains(info, []byte(" "+fusectlDir+" ")) {
		return nil
	}
	if err := unix.Mount("fusectl", fusectlDir, "fusectl", 0, ""); err != nil && !errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("mount fusectl on %s: %w", fusectlDir, err)
	}
	return nil
}

// startTime is field 22 of /proc/PID/stat (when the process started, in
// clock ticks since boot): with the pid, it names one process.
func startTime(pid int) (uint64, error) {
	_, start, err := procState(pid)
	return start, err
}

// procState reads a process's state letter and start time.
func procState(pid int) (byte, uint64, error) {
	f, err := procStat(pid)
	if err != nil {
		return 0, 0, err
	}
	start, err := strconv.ParseUint(string(f[19]), 10, 64)
	return f[0][0], start, err
}

// closeFuse closes this process's descriptors of /dev/fuse.
func closeFuse() error {
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return err
	}
	for _, e := range fds {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if to, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name())); err == nil && to == "/dev/fuse" {
			if err := unix.Close(fd); err != nil {
				return fmt.Errorf("close /dev/fuse (%d): %w", fd, err)
			}
		}
	}
	return nil
}

// runWatchdog is the watchdog: PID START DEV DIR.
func runWatchdog(args []string) error {
	if len(args) != 4 {
		return fmt.Errorf("want PID START DEV DIR")
	}
	pid, err1 := strconv.Atoi(args[0])
	start, err2 := strconv.ParseUint(args[1], 10, 64)
	dev, dir := args[2], args[3]
	_, minor, ok := strings.Cut(dev, ":")
	conn, err3 := strconv.ParseUint(minor, 10, 64)
	if err := errors.Join(err1, err2, err3); err != nil || !ok {
		return fmt.Errorf("bad arguments %q: %v", args, err)
	}
	// The daemon's /dev/fuse comes across the exec (go-fuse opens it
	// without O_CLOEXEC): held here, it would keep the connection up
	// after the daemon.
	if err := closeFuse(); err != nil {
		return err
	}
	abort := filepath.Join(fusectlDir, strconv.FormatUint(conn, 10), "abort")
	for {
		time.Sleep(watchEvery)
		state, st, err := procState(pid)
		if err == nil && st == start && state != 'Z' && state != 'X' {
			continue // alive
		}
		// Dead, or dying with a thread stuck: give its exit the time to
		// close the connection, then end it (an abort of a connection
		// whose daemon closed it changes nothing; its directory stays
		// until the mount goes).
		for deadline := time.Now().Add(abortGrace); time.Now().Before(deadline); time.Sleep(watchEvery) {
			if !stillMounted(dev, dir) {
				return nil // unmounted: the number may be another mount's now
			}
		}
		if !stillMounted(dev, dir) {
			return nil
		}
		if err := os.WriteFile(abort, []byte("1"), 0); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("abort connection %d of daemon %d: %w", conn, pid, err)
		}
		return nil
	}
}
