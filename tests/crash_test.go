package tests

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestCrashRestart kills the daemon with SIGKILL while dd is in the middle
// of writing a file. The dead mount must fail fast (ENOTCONN, no hang), and
// a new daemon on the same mountpoint must come up and serve.
func TestCrashRestart(t *testing.T) {
	t.Parallel()
	dir := newMountpoint(t)
	d1 := startDaemonAt(t, dir, "--size", "128MiB")
	run(t, "sh", "-c", `printf before > "$1"`, "sh", filepath.Join(dir, "before"))

	// dd copies from a pipe the test feeds, so it is provably mid-write
	// (the file open, part of it written, nothing committed) at the kill.
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), cmdTimeout)
	defer cancel()
	var ddOut syncBuffer
	dd := command(ctx, "dd", "of="+filepath.Join(dir, "inflight"), "bs=1M", "iflag=fullblock")
	dd.Stdin, dd.Stdout, dd.Stderr = pr, &ddOut, &ddOut
	if err := dd.Start(); err != nil {
		t.Fatal(err)
	}
	pr.Close()
	ddDone := make(chan struct{})
	var ddErr error
	go func() {
		ddErr = dd.Wait()
		close(ddDone)
	}()
	t.Cleanup(func() {
		pw.Close()
		cancel()
		<-ddDone
	})

	base := d1.status(t).Transfer.BytesWritten
	chunk := make([]byte, 4*miB)
	for i := range chunk {
		chunk[i] = byte(i*7 + i>>12)
	}
	if _, err := pw.Write(chunk); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "dd to write 4 MiB into the mount", func() (bool, string) {
		s := d1.status(t)
		return s.Transfer.BytesWritten >= base+uint64(len(chunk)), fmt.Sprintf("%+v", s.Transfer)
	})
	if st := d1.status(t); st.OpenObjects < 1 {
		t.Errorf("status open_objects = %d while dd writes", st.OpenObjects)
	}

	d1.kill9(t)
	// dd's next write (or its close) fails: the connection is gone.
	_, _ = pw.Write(chunk[:miB])
	pw.Close()
	<-ddDone
	if err := ddErr; err == nil {
		t.Errorf("dd into a killed daemon succeeded:\n%s", ddOut.String())
	} else if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		t.Fatalf("dd hung after the daemon was killed:\n%s", ddOut.String())
	} else {
		t.Logf("dd after the kill: %v: %s", err, strings.TrimSpace(ddOut.String()))
	}

	// The dead mount answers ENOTCONN at once, it does not hang.
	out, err := runErr("timeout", "20", "ls", dir)
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee) && ee.ExitCode() == 124:
		t.Fatalf("ls of the dead mount hung (killed by timeout):\n%s", out)
	case err == nil:
		t.Errorf("ls of the dead mount succeeded:\n%s", out)
	case !strings.Contains(out, "Transport endpoint is not connected"):
		t.Errorf("ls of the dead mount: %v, want ENOTCONN:\n%s", err, out)
	}

	d2 := startDaemonAt(t, dir, "--size", "128MiB")
	// Nothing half-written is visible: the store is memory, so the file
	// is gone; if a future daemon keeps the namespace, it may exist only
	// as the empty file that open(O_CREAT) made.
	if out, err := runErr("stat", "--cached=never", "-c", "%s", filepath.Join(dir, "inflight")); err == nil && strings.TrimSpace(out) != "0" {
		t.Errorf("the file being written at the crash is visible after restart with %s B", strings.TrimSpace(out))
	}
	src := filepath.Join(t.TempDir(), "src")
	writeRandom(t, src, 3*miB+5, 9)
	run(t, "cp", src, filepath.Join(dir, "after"))
	run(t, "cmp", src, filepath.Join(dir, "after"))
	run(t, "ls", "-la", dir)
	d2.checkAlive(t)
}

// TestRestartAfterCleanStop: a daemon stopped with SIGTERM unmounts, and a
// new one mounts the same mountpoint.
func TestRestartAfterCleanStop(t *testing.T) {
	t.Parallel()
	dir := newMountpoint(t)
	d1 := startDaemonAt(t, dir, "--size", "16MiB")
	run(t, "sh", "-c", `printf one > "$1"`, "sh", filepath.Join(dir, "f"))
	d1.stop(t)
	if mounted(dir) {
		t.Fatalf("%s is still mounted after SIGTERM", dir)
	}
	startDaemonAt(t, dir, "--size", "16MiB")
	run(t, "sh", "-c", `printf two > "$1" && test "$(cat "$1")" = two`, "sh", filepath.Join(dir, "f"))
}
