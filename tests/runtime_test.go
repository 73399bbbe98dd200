package tests

import (
	"bytes"
	"os"
	"strconv"
	"strings"
	"testing"
)

// daemonEnv is the environment the daemon's process runs with (its last
// exec's), NAME=value each.
func daemonEnv(t *testing.T, d *daemon) []string {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(d.cmd.Process.Pid) + "/environ")
	if err != nil {
		t.Fatal(err)
	}
	var env []string
	for kv := range bytes.SplitSeq(bytes.TrimRight(b, "\x00"), []byte{0}) {
		env = append(env, string(kv))
	}
	return env
}

// envOf is the value of name that a program with env reads (the first
// one's) and how many variables of that name env has.
func envOf(env []string, name string) (string, int) {
	var v string
	n := 0
	for _, kv := range env {
		if val, ok := strings.CutPrefix(kv, name+"="); ok {
			if n == 0 {
				v = val
			}
			n++
		}
	}
	return v, n
}

// TestDaemonFreesHeapLazily: the daemon runs with the runtime's
// madvdontneed=0 (freed heap goes back to the kernel with MADV_FREE),
// added to the settings of the GODEBUG it was started with, and it keeps
// a madvdontneed that GODEBUG names. It re-executes itself once for it,
// and serves either way.
func TestDaemonFreesHeapLazily(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ start, want string }{
		{"", "madvdontneed=0"},
		{"gctrace=0", "gctrace=0,madvdontneed=0"},
		{"madvdontneed=1", "madvdontneed=1"},
	} {
		d := startDaemonEnv(t, newMountpoint(t), []string{"GODEBUG=" + c.start, "MOONCAKE_FS_REEXEC="}, "--size", "64MiB")
		run := daemonEnv(t, d)
		if got, n := envOf(run, "GODEBUG"); got != c.want || n != 1 {
			t.Errorf("started with GODEBUG=%q: runs with GODEBUG=%q (%d of them), want %q", c.start, got, n, c.want)
		}
		// As root the daemon may re-execute for splice too.
		if again, _ := envOf(run, "MOONCAKE_FS_REEXEC"); c.want != c.start && again != "1" {
			t.Errorf("started with GODEBUG=%q: MOONCAKE_FS_REEXEC=%q, want 1", c.start, again)
		}
		if err := os.WriteFile(d.dir+"/k", []byte("v"), 0o644); err != nil {
			t.Fatal(err)
		}
		if got, err := os.ReadFile(d.dir + "/k"); err != nil || string(got) != "v" {
			t.Fatalf("read back: %q, %v", got, err)
		}
		d.stop(t)
	}
}

// TestDaemonHeapLimit: the daemon runs with a soft memory limit of four
// times its metadata bound and 1 GiB (status shows it, with the heap
// in use), unless GOMEMLIMIT sets one. Without it, a burst of requests
// (a thousand 1 MiB reads at once) left the collector's goal at
// gigabytes, which later traffic filled.
func TestDaemonHeapLimit(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "64MiB")
	st := d.status(t)
	if want := int64(4*st.Metadata.Limit + 1<<30); st.Memory.HeapLimit != want || st.Metadata.Limit == 0 {
		t.Errorf("heap limit %d with a metadata bound of %d, want %d", st.Memory.HeapLimit, st.Metadata.Limit, want)
	}
	if st.Memory.HeapBytes == 0 || int64(st.Memory.HeapBytes) > st.Memory.HeapLimit {
		t.Errorf("heap in use %d, limit %d", st.Memory.HeapBytes, st.Memory.HeapLimit)
	}
	if out := run(t, daemonBin(), "status", d.dir); !strings.Contains(out, "soft limit") {
		t.Errorf("status shows no heap line:\n%s", out)
	}
	d.stop(t)
	d = startDaemonEnv(t, newMountpoint(t), []string{"GOMEMLIMIT=300MiB"}, "--size", "64MiB")
	if got := d.status(t).Memory.HeapLimit; got != 300<<20 {
		t.Errorf("started with GOMEMLIMIT=300MiB: heap limit %d, want %d", got, 300<<20)
	}
}
