// Command mooncake-fs mounts a Mooncake-style in-memory object store as a
// file system and drives it: mount (the daemon), umount, status, put, get,
// bench.
package main

import (
	"fmt"
	"os"
	"runtime"
)

const usage = `mooncake-fs: an in-memory object store served as files

usage:
  mooncake-fs mount  [flags] [MOUNTPOINT]   run the daemon (default /mnt/mooncake)
  mooncake-fs umount [MOUNTPOINT]           unmount
  mooncake-fs status [--json] [MOUNTPOINT]  capacity, use, memory, evictions
  mooncake-fs put    [flags] FILE KEYPATH   store FILE ("-": stdin) as KEYPATH, a path on the mount
  mooncake-fs get    [flags] KEYPATH FILE   read KEYPATH into FILE ("-": stdout)
  mooncake-fs bench  [--json] [--case A,B]  benchmarks against same-run ceilings

Run "mooncake-fs COMMAND -h" for the flags of a command.
`

const defaultMountpoint = "/mnt/mooncake"

// init keeps the main goroutine on the process's first thread, and every
// other goroutine off it. A signal sent to the process (SIGTERM, SIGINT)
// goes to that thread first. A daemon copy blocked in a page fault (a
// get into a client's mapping of a file on a stalled file system) sleeps
// where only fatal signals wake it, and a signal given to that thread
// waited there until the copy ended: "stop" never came, however long the
// stop timeout. The main goroutine only waits for signals and its
// commands' ends, so its thread always takes them.
func init() { runtime.LockOSThread() }

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	var err error
	switch cmd, args := os.Args[1], os.Args[2:]; cmd {
	case "mount":
		err = runMount(args)
	case "umount", "unmount":
		err = runUmount(args)
	case "status":
		err = runStatus(args)
	case "put":
		err = runPut(args)
	case "get":
		err = runGet(args)
	case "bench":
		err = runBench(args)
	case watchdogCmd: // started by the daemon (watchdog.go)
		err = runWatchdog(args)
	case "-h", "--help", "help":
		fmt.Print(usage)
	default:
		fmt.Fprintf(os.Stderr, "mooncake-fs: unknown command %q\n\n%s", cmd, usage)
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "mooncake-fs %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}

// mountpointArg returns the single optional positional argument.
func mountpointArg(args []string) (string, error) {
	switch len(args) {
	case 0:
		return defaultMountpoint, nil
	case 1:
		return args[0], nil
	}
	return "", fmt.Errorf("want at most one mountpoint, got %q", args)
}
