package main

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
)

// procStat returns the fields of /proc/PID/stat from the third on (the
// state is [0], utime [11], stime [12], starttime [19]): the command name
// before them, in parentheses, may hold spaces and parentheses. It has
// at least 20.
func procStat(pid int) ([][]byte, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return nil, err
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil, fmt.Errorf("/proc/%d/stat: no command name", pid)
	}
	f := bytes.Fields(b[i+1:])
	if len(f) < 20 {
		return nil, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f)+2)
	}
	return f, nil
}
