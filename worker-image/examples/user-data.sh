#!/bin/bash
# EC2 user data for an onoff GPU worker (a template: fill in the values below when rendering the
# launch template). It installs a systemd unit that pulls the worker image and runs the agent, and
# shuts the instance down whenever that unit stops, however it stops: the agent's idle exit, a
# failed pull, a crash. The launch template sets instance-initiated shutdown = terminate, so no GPU
# instance is left running without an agent.
#
# For an AMI with Docker, the NVIDIA driver, the NVIDIA Container Toolkit and the AWS CLI (AWS Deep
# Learning Base GPU AMI, ECS GPU-optimized AMI). The instance profile needs ECR pull rights besides
# the agent's own (SQS, DynamoDB, S3, ec2:TerminateInstances on itself).
#
# The agent reads IMDSv2 from inside the container: `--network host` here; with Docker's default
# bridge network the launch template must set the metadata hop limit to 2.
set -euo pipefail

ONOFF_IMAGE="123456789012.dkr.ecr.us-east-1.amazonaws.com/onoff-worker:1"
AWS_REGION="us-east-1"

install -d -m 0755 /etc/onoff
cat > /etc/onoff/agent.env <<ENV
AWS_REGION=${AWS_REGION}
ONOFF_QUEUE_URLS=express=https://sqs.us-east-1.amazonaws.com/123456789012/onoff-express,standard=https://sqs.us-east-1.amazonaws.com/123456789012/onoff-standard
ONOFF_JOBS_TABLE=onoff-jobs
ONOFF_WORKERS_TABLE=onoff-workers
ONOFF_BUCKET=onoff-123456789012-us-east-1
ONOFF_IDLE_TIMEOUT_S=600
ENV
# GPUs of this instance: the agent hands jobs that ask for more back to the queue.
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "$GPUS" -gt 0 ]; then echo "ONOFF_GPUS=$GPUS" >> /etc/onoff/agent.env; fi

# Work dir on the host (instance store or EBS), owned by the image's `onoff` user (UID 10001).
install -d -o 10001 -g 10001 -m 0750 /var/lib/onoff

# /dev/shm of the container (and its jobs): half of the instance's memory, as a Linux host sizes
# its own. Docker's default, 64 MiB, is too little for PyTorch's DataLoader workers or NCCL.
SHM_MIB=$(awk '/^MemTotal:/ { print int($2 / 2048) }' /proc/meminfo)

cat > /usr/local/bin/onoff-pull <<PULL
#!/bin/bash
# Log in to ECR and pull the worker image, with a few retries.
set -uo pipefail
for attempt in 1 2 3 4 5; do
    aws ecr get-login-password --region "${AWS_REGION}" \\
        | docker login --username AWS --password-stdin "${ONOFF_IMAGE%%/*}" \\
        && docker pull "${ONOFF_IMAGE}" && exit 0
    sleep \$((attempt * 10))
done
exit 1
PULL
chmod 0755 /usr/local/bin/onoff-pull

# --stop-timeout / TimeoutStopSec: when the host stops the container, the agent gets time to let its
# job checkpoint and to release it (Docker's default is 10 s). --ulimit: the open-file limits
# Amazon Linux 2's Docker gives containers (32768 soft, 65536 hard), on any AMI: Docker 25 and later
# elsewhere give 1024, too few for PyTorch's DataLoader workers sharing tensors.
cat > /etc/systemd/system/onoff-agent.service <<UNIT
[Unit]
Description=onoff worker agent
Wants=network-online.target
After=docker.service network-online.target
Requires=docker.service

[Service]
Type=simple
ExecStartPre=-/usr/bin/docker rm -f onoff-agent
ExecStartPre=/usr/local/bin/onoff-pull
ExecStart=/usr/bin/docker run --name onoff-agent --rm --gpus all --network host --stop-timeout 120 --shm-size ${SHM_MIB}m --ulimit nofile=32768:65536 --env-file /etc/onoff/agent.env -v /var/lib/onoff:/var/lib/onoff ${ONOFF_IMAGE}
ExecStop=/usr/bin/docker stop -t 120 onoff-agent
TimeoutStartSec=900
TimeoutStopSec=150
Restart=no
ExecStopPost=/bin/sh -c 'echo "onoff-agent stopped (\$SERVICE_RESULT, exit \$EXIT_STATUS): shutting down" > /dev/console; /sbin/shutdown -h now'

[Install]
WantedBy=multi-user.target
UNIT

systemctl daemon-reload
# Enabled: user data runs at the first boot only, and a worker the control plane stopped and
# started again must boot into its agent (the image is on its volume already).
systemctl enable onoff-agent.service
systemctl start --no-block onoff-agent.service
