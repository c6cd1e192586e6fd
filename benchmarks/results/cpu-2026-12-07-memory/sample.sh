#!/bin/bash
# usage: sample.sh ROOT_PID LOG: every 30 s, the UTC time, seconds since start, the RSS (MiB) of every process
# under ROOT_PID (the whole tree), their sum, the machine's available memory and load
root=$1; log=$2; start=$(date +%s)
while kill -0 $root 2>/dev/null; do
  line=$(ps -eo pid=,ppid=,rss= | awk -v root=$root '{p[$1]=$2; r[$1]=$3} END {for (i in p) {j=i; while (j in p && j!=root) j=p[j]; if (j==root && r[i] > 20000) printf "%d ", r[i]/1024}}')
  sum=$(echo $line | tr ' ' '\n' | awk '{s+=$1} END {print s}')
  echo "$(date -u +%H:%M:%S) t=$(( $(date +%s) - start ))s rss_mib=[$line] sum=$sum avail_mib=$(awk '/MemAvailable/{print int($2/1024)}' /proc/meminfo) load=$(cut -d' ' -f1 /proc/loadavg)" >> $log
  sleep 30
done
echo "$(date -u +%H:%M:%S) t=$(( $(date +%s) - start ))s done" >> $log
