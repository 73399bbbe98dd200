// Command probe checks with the ioctl probes (GET_MAGIC, GET_ABI_VERSION)
// that a file is on a mooncake-fs mount. The end-to-end tests run it as a
// child process so that the test binary never opens a file on a mount.
//
// It prints "mooncake magic=0x... abi=MAJOR.MINOR" and exits 0; it exits 3
// for a file of another file system and 1 on any other error.
package main

import (
	"errors"
	"fmt"
	"os"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: probe FILE")
		os.Exit(2)
	}
	f, err := os.Open(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer f.Close()
	v, err := ioctl.Probe(f)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		if errors.Is(err, ioctl.ErrNotMooncake) {
			os.Exit(3)
		}
		os.Exit(1)
	}
	// Probe has checked the magic the daemon answered against MagicValue.
	fmt.Printf("mooncake magic=%#x abi=%d.%d\n", ioctl.MagicValue, v.Major, v.Minor)
}
