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
